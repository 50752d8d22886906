"""The project's tokenizer (trained on the retail world) and its Qwen2.5-style chat template; tiny and
7B-shaped Qwen2 configurations."""

import json

import pytest
import torch

from sinkflex_core.models import (
    CHAT_TEMPLATE,
    DEFAULT_VOCAB_SIZE,
    IM_END,
    IM_START,
    PAD_TOKEN,
    TOOL_TOKENS,
    build_model,
    count_parameters,
    get_tokenizer,
    load_tokenizer,
    qwen25_7b_config,
    retail_corpus,
    tiny_qwen2_config,
    train_tokenizer,
    wrap_tokenizer,
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_order_details", "description": "Look an order up.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def test_vocabulary_size_and_special_ids(tok):
    assert len(tok) == DEFAULT_VOCAB_SIZE == 3072
    assert tok.convert_tokens_to_ids([PAD_TOKEN, IM_START, IM_END]) == [0, 1, 2]
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    assert tok.convert_tokens_to_ids(TOOL_TOKENS) == [3068, 3069, 3070, 3071]
    # Each tag is one id wherever it appears in text.
    ids = tok.encode("x<tool_call>y</tool_call><|im_end|>", add_special_tokens=False)
    assert 3068 in ids and 3069 in ids and ids[-1] == 2


def test_decoding_keeps_tool_tags_but_drops_special_tokens(tok):
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "calculate"}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == 'assistant\n<tool_call>\n{"name": "calculate"}\n</tool_call>'


def test_retail_text_round_trips_and_is_compact(tok):
    texts = retail_corpus(max_tasks=3)
    chars = tokens = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        chars, tokens = chars + len(text), tokens + len(ids)
    # A byte-level tokenizer would spend one id per byte; ours learned the world's words and keys.
    assert tokens < 0.6 * chars, (tokens, chars)
    # Digit runs are cut into groups of up to three from the left, each group one token.
    assert tok.tokenize("#W2611340")[-3:] == ["261", "134", "0"]
    assert tok.tokenize("1387882051") == ["138", "788", "205", "1"]
    assert tok.tokenize("$63.64")[-3:] == ["63", ".", "64"]


def test_a_value_is_the_same_tokens_in_a_sentence_and_in_a_tool_call(tok):
    # A policy copies a customer's name, city or zip into a call token by token; with GPT-2's rule
    # " Green" (after a space) and "Green" (after a quote) would be different ids.
    def span(text: str, value: str) -> list[str] | None:
        """The tokens of ``text`` that decode to exactly ``value``, if there are such."""
        toks = tok.tokenize(text)
        for i in range(len(toks)):
            for j in range(i + 1, len(toks) + 1):
                if tok.convert_tokens_to_string(toks[i:j]) == value:
                    return toks[i:j]
        return None

    for value in ("Anya", "Green", "Miami", "Apt 30", "Oak Street", "92181", "lucia.khan5974@example.com"):
        sentence = span(f"I am {value}, thanks.", value)
        call = span(f'{{"value": "{value}"}}', value)
        assert sentence is not None and sentence == call, (value, sentence, call)


def test_every_group_of_up_to_three_digits_is_one_token(tok):
    groups = [f"{i:0{w}d}" for w in (1, 2, 3) for i in range(10**w)]
    assert len(groups) == 1110
    vocab = tok.get_vocab()
    assert [g for g in groups if g not in vocab] == []
    assert all(len(tok.encode(g, add_special_tokens=False)) == 1 for g in groups[::7])


def test_training_is_deterministic_and_lossless():
    texts = retail_corpus(max_tasks=5)
    a = train_tokenizer(texts, 1024)
    b = train_tokenizer(texts, 1024)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 1024
    for text in texts[:20]:
        assert a.decode(a.encode(text).ids) == text
    c = train_tokenizer(texts[: len(texts) // 3], 1024)  # the corpus does shape the merges
    assert c.get_vocab_size() == 1024 and c.to_str() != a.to_str()
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(texts, 100)


def test_cached_tokenizer_is_the_same(tok, monkeypatch):
    """The tokenizer read back from build/tokenizers/ (written when ``tok`` was made) equals one trained
    afresh without the cache."""
    import sinkflex_core.models as models

    fresh = get_tokenizer(cache=False)
    with monkeypatch.context() as m:  # the cached call must not train: it reads the file
        m.setattr(models, "train_tokenizer", lambda *a, **k: pytest.fail("the cached tokenizer was retrained"))
        cached = get_tokenizer()
    assert cached.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    sample = "Order #W2378156: 3 items, $1,234.56 to 'Yusuf Rossi' <|im_end|>\n{\"order_id\": \"#W1\"}"
    assert cached.encode(sample) == fresh.encode(sample) and len(cached) == len(fresh)
    assert cached.chat_template == fresh.chat_template == CHAT_TEMPLATE


def _render(tok, messages, tools=None, gen=False):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_template_matches_qwen25_layout(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is #W1?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_order_details", "arguments": {"order_id": "#W1"}}}]},
        {"role": "tool", "content": '{"status": "pending"}'},
        {"role": "assistant", "content": "It is pending."},
    ]
    text = _render(tok, messages, TOOLS, gen=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # One JSON signature per line between <tools> and </tools>.
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in system
    assert rest == (
        "<|im_start|>user\nWhere is #W1?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_order_details\", \"arguments\": {\"order_id\": \"#W1\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"status\": \"pending\"}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is pending.<|im_end|>\n")
    assert _render(tok, messages, TOOLS, gen=True) == text + "<|im_start|>assistant\n"


def test_template_merges_consecutive_tool_results_and_defaults_system(tok):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "1+1"}}},
            {"function": {"name": "calculate", "arguments": '{"expression": "2+2"}'}}]},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "4"},
    ]
    text = _render(tok, messages)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"calculate\", \"arguments\": {\"expression\": \"1+1\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"calculate\", \"arguments\": {\"expression\": \"2+2\"}}\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>\n")


def test_tokenizer_saved_beside_a_policy_reloads_unchanged(tok, tmp_path):
    """A policy folder holds config.json (model_type qwen2) and the tokenizer; transformers 5's
    AutoTokenizer then builds Qwen2Tokenizer with its own pre-tokenizer. load_tokenizer (used by the
    trainer) must give back the tokenization the policy was trained with."""
    from sinkflex_core.train import TrainConfig
    from sinkflex_core.train import load_tokenizer as trainer_tokenizer

    build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=1, tokenizer=tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    texts = retail_corpus(max_tasks=2)[-40:] + ['"zip": "85012", "#W2611340", 1387882051, $63.64']
    for again in (load_tokenizer(str(tmp_path)),
                  trainer_tokenizer(TrainConfig(model=str(tmp_path), out_dir=str(tmp_path / "run")))):
        assert [again.encode(t, add_special_tokens=False) for t in texts] == \
            [tok.encode(t, add_special_tokens=False) for t in texts]
        messages = [{"role": "user", "content": "Cancel #W2611340 please."}]
        assert again.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False) == \
            tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        assert again.eos_token_id == 2 and again.pad_token_id == 0


def test_wrapped_tokenizer_saves_and_reloads(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Cancel #W2611340 please."}]
    assert again.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False) == \
        tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert again.eos_token_id == 2


def test_tiny_config_and_model(tok):
    cfg = tiny_qwen2_config(len(tok), tokenizer=tok)
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM's CPU attention needs >= 32
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.eos_token_id == 2 and cfg.pad_token_id == 0
    model = build_model(cfg, seed=0)
    assert 4.5e6 < count_parameters(model) < 5.0e6
    same, other = build_model(cfg, seed=0), build_model(cfg, seed=1)
    pairs = list(zip(model.state_dict().values(), same.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    out = model(torch.tensor([[1, 5, 9, 2]]))
    assert out.logits.shape == (1, 4, 3072) and torch.isfinite(out.logits).all()


def test_bad_configs_say_why(tok):
    with pytest.raises(ValueError, match="multiple of num_heads"):
        tiny_qwen2_config(2048, hidden_size=250, num_heads=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_qwen2_config(2048, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="tokenizer has 3072 ids"):
        tiny_qwen2_config(1000, tokenizer=tok)


def test_qwen25_7b_shape():
    from transformers import Qwen2ForCausalLM

    cfg = qwen25_7b_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (3584, 28, 28, 4, 18944, 152064)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    # Qwen2.5-7B's published count: 7.62B parameters (untied embeddings, q/k/v biases).
    assert count_parameters(model) == 7_615_616_512


def test_wrap_tokenizer_needs_no_corpus_of_ours():
    tok = wrap_tokenizer(train_tokenizer(["hello world"] * 20 + ["order #W1 is pending"] * 20, 300))
    assert len(tok) == 300
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_previous_token_heads_attend_one_and_two_tokens_back():
    from sinkflex_core.models import init_previous_token_heads

    cfg = tiny_qwen2_config(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg._attn_implementation = "eager"
    model = build_model(cfg, seed=0)
    other = {k: v.clone() for k, v in model.state_dict().items()}
    mins = init_previous_token_heads(model, offsets=(1, 2), n_pos=192, steps=150)
    assert len(mins) == 2 and min(mins) > 0.9
    ids = torch.randint(3, 500, (2, 192), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions[0]  # (B, heads, L, L)
    i = torch.arange(192)
    # whatever the tokens: head 0 looks one token back, head 1 two tokens back
    assert att[:, 0, i[1:], i[1:] - 1].min() > 0.9 and att[:, 1, i[2:], i[2:] - 2].min() > 0.9
    # only the first KV group's query/key projections of layer 0 changed
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, other[k])}
    assert changed == {f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qk" for w in ("weight", "bias")}
    D = 16
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight[2 * D:], other["model.layers.0.self_attn.q_proj.weight"][2 * D:])
    with pytest.raises(ValueError, match="offsets but a KV group has 2"):
        init_previous_token_heads(model, offsets=(1, 2, 3))
    with pytest.raises(ValueError, match="kv_head"):
        init_previous_token_heads(model, kv_head=2)
