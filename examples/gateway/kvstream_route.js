// nginx njs: ask kvstream serve which engine should take an OpenAI completions request,
// then proxy the request there. Used by examples/gateway/nginx.conf.
//
// The prompt goes to POST /v1/route as token ids (a prompt given as a list of ints) or as
// text (needs `kvstream serve --tokenizer`). If kvstream cannot answer, the request still
// goes somewhere: the fallback engine.

const FALLBACK = 'e0';

async function route(r) {
    let body = {};
    try {
        body = JSON.parse(r.requestText || '{}');
    } catch (e) {
        r.return(400, '{"error": "the request body is not JSON"}\n');
        return;
    }
    const prompt = body.prompt;
    const ask = Array.isArray(prompt) ? {token_ids: prompt} : {prompt: String(prompt || '')};
    let engine = FALLBACK;
    try {
        const reply = await r.subrequest('/_kvstream_route', {method: 'POST', body: JSON.stringify(ask)});
        if (reply.status == 200) {
            engine = JSON.parse(reply.responseText).engine || FALLBACK;
        } else {
            r.warn('kvstream /v1/route answered ' + reply.status + ': ' + reply.responseText);
        }
    } catch (e) {
        r.warn('kvstream /v1/route failed: ' + e);
    }
    r.variables.kv_engine = engine;
    r.internalRedirect('@engine');
}

export default {route};
