"""``/v1/route {"prompt": text}`` tokenizes the text as vLLM tokenizes a completion's prompt:
with the special tokens the tokenizer's post-processor adds (a BOS). Found against real
vLLM 0.32 (bench/vllm_engine): without the BOS every block key was shifted by one token and
``/v1/route`` predicted 0 cached tokens where the engine reused 1,280 of 2,188."""

from __future__ import annotations


def test_a_text_prompt_is_routed_with_the_bos_the_engine_adds(engines, serve, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from kvstream.proxy.tokenize import load_tokenizer

    words = [f"w{i}" for i in range(200)]
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    text = " ".join(words[:63])
    ids = tok.encode(text).ids  # what vLLM's /v1/completions computes: BOS + 63 words
    assert ids[0] == 1 and len(ids) == 64
    assert load_tokenizer(tmp_path / "model").encode(text) == ids  # and what the proxy routes with

    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--tokenizer", str(tmp_path / "model"), "--load-interval", "0")
    srv.wait_applied("e0", e0.admit(ids, "r"))
    r = srv.route(prompt=text + " w100 w101")
    assert r["engine"] == "e0" and r["matched_tokens"] == 64
    assert srv.route(prompt=text)["matched_tokens"] == 64
