"""Tiny models and the project's tokenizer.

The tokenizer is a byte-level BPE trained here, in seconds, on the retail world's own text (tool
schemas, the policy, customer messages, tool outputs and oracle replies of expert conversations), so
that records such as ``#W2611340`` or ``noah_brown_6181`` cost few tokens and nothing is downloaded.
Runs of digits are cut into groups of up to three from the left (``2611340`` -> ``261 134 0``), as
the Llama 3 and GPT-4 tokenizers do, and every group is one token: an id is copied in three or four
steps whose tokens rarely repeat in a context, which a small model learns far sooner than copying
single digits.
It carries a chat template with tools in the Qwen2.5 format: the same rollout and training code then
drives a real Qwen2.5-Instruct checkpoint and the project's tiny Qwen2-architecture models.

Qwen2.5's format, which the template reproduces (its wording is ours):

- a system turn that holds the system prompt and, when tools are given, one JSON signature per tool
  inside ``<tools>...</tools>`` plus how to call them;
- an assistant tool call rendered as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- tool results given back as a *user* turn holding one ``<tool_response>`` block per result
  (consecutive results share one turn);
- ``add_generation_prompt`` opens ``<|im_start|>assistant\\n``; every turn ends ``<|im_end|>\\n``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from .paths import atomic_path, build_dir

log = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Added (not special) tokens, as in Qwen2.5: one id each, and kept when decoding with
# skip_special_tokens=True, so that a decoded assistant turn still shows its tool call.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# The chat template (Jinja, rendered by transformers' sandboxed environment). Bump TEMPLATE_VERSION
# when the text changes so that cached tokenizers are rebuilt.
TEMPLATE_VERSION = 2
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system_text = messages[0].content -%}"
    "{%- else -%}"
    "{%- set system_text = '" + DEFAULT_SYSTEM_PROMPT + "' -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system_text -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nThese functions are available to you; their JSON signatures are listed one per "
    "line between <tools> and </tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and its arguments "
    "between <tool_call> and </tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------

def retail_corpus(max_tasks: int = 40, world_seed: int = 0) -> list[str]:
    """The retail world's text, in a fixed order: the policy and the tool schemas; every product,
    user and order record as the tools print them; then the expert conversations of the first
    ``max_tasks`` training tasks (customer messages, tool calls and outputs, oracle replies).

    Deterministic: the world, the tasks and the scripted customer are all seeded."""
    import gymnasium as gym

    from . import envs

    env = gym.make("sinkflex/Retail-v0", split="train")
    try:
        _, info = env.reset(seed=0, options={"task_index": 0})
        texts = [info["policy"]] + [json.dumps(tool, ensure_ascii=False) for tool in info["tools"]]
        n_tasks = min(max_tasks, env.unwrapped.num_tasks)
    finally:
        env.close()
    world = envs.RetailWorld.get(world_seed)
    conn = world.new_episode_db()
    try:
        tools = envs.RetailTools(conn)
        for name, arg, keys in (("get_product_details", "product_id", world.data.products),
                                ("get_user_details", "user_id", world.data.users),
                                ("get_order_details", "order_id", world.data.orders)):
            texts.extend(tools.call(name, {arg: key}).output for key in sorted(keys))
    finally:
        conn.close()
    for i in range(n_tasks):
        messages, _ = envs.expert_conversation("sinkflex/Retail-v0", "train", i)
        for message in messages:
            if message["role"] == "system":
                continue  # the policy text is already in
            if message.get("content"):
                texts.append(message["content"])
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                texts.append(json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False))
    return texts


def _corpus_fingerprint(max_tasks: int, vocab_size: int) -> str:
    """A key for the cached tokenizer: everything the corpus and the training depend on (the
    environments' source, the template, the settings), cheap to compute (no corpus needed)."""
    from . import envs

    h = hashlib.sha256(f"v{TEMPLATE_VERSION}|{vocab_size}|{max_tasks}|".encode())
    h.update(Path(__file__).read_bytes())
    for path in sorted(Path(envs.__file__).parent.rglob("*")):
        if path.is_file() and path.suffix in {".py", ".md", ".json"}:
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


DEFAULT_VOCAB_SIZE = 3072  # the retail corpus needs ~2,450 ids; the rest are reserved


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE (a ``tokenizers.Tokenizer``) of exactly ``vocab_size`` ids on ``texts``.

    Ids 0-2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (special); the four tool tags
    are the last ids; ids the corpus has no merges for are ``<|reserved_k|>`` special tokens.
    Digit runs are split into groups of up to three from the left before BPE (as in Llama 3); with
    ``vocab_size`` >= ~2,500 the retail corpus makes every group of one to three digits a single token.
    Runs of letters are split off too, so a space never merges into the word after it: a name, a
    city or a key is the same token in the customer's sentence (``I am Anya Green``) and in the tool
    call or record that repeats it (``"first_name": "Anya"``). With GPT-2's rule (``" Green"`` one
    token, ``"Green"`` after a quote split as ``G`` + ``reen``) copying a value across the two needs a
    spelling map per word, which a tiny model trained from scratch cannot learn for users it has not
    seen; the separate spaces cost about 3 % more tokens on the retail corpus.
    Training is deterministic for a given list of texts."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    n_fixed = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < 256 + n_fixed + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
                         f"{256 + n_fixed + 1} ids (256 bytes, {n_fixed} special/tool tokens, one merge)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet, min_frequency=2, show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    # A small, regular corpus runs out of merges before vocab_size (the retail world supports ~2,450
    # ids); the rest are reserved special tokens, so that the vocabulary size is always the one asked
    # for and model shapes do not depend on the corpus.
    n_reserved = vocab_size - len(TOOL_TOKENS) - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                            for i in range(n_reserved)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def wrap_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` as a transformers fast tokenizer with our special tokens and the
    Qwen2.5-style chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, bos_token=None, unk_token=None,
        padding_side="left", model_max_length=131072, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def get_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, max_tasks: int = 40, cache: bool = True):
    """The project's tokenizer: a byte-level BPE of exactly ``vocab_size`` ids trained on the retail
    world's text (:func:`retail_corpus`), with the chat template. Training takes a few seconds; the
    result is cached in ``build/tokenizers/`` under a key of the environments' source, the template and
    the settings, so later calls load it in milliseconds."""
    from tokenizers import Tokenizer

    path: Path = build_dir() / "tokenizers" / f"retail-bpe-{vocab_size}-{_corpus_fingerprint(max_tasks, vocab_size)}.json"
    if cache and path.is_file():
        return wrap_tokenizer(Tokenizer.from_file(str(path)))
    tok = train_tokenizer(retail_corpus(max_tasks), vocab_size)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # parallel test workers never read half a file
            tok.save(str(tmp))
    return wrap_tokenizer(tok)


def load_tokenizer(name_or_path: str):
    """A tokenizer from a folder or hub id, exactly as it was saved.

    ``AutoTokenizer`` in transformers 5 picks the tokenizer class from the folder's ``config.json``
    (``model_type: qwen2`` -> ``Qwen2Tokenizer``), and that class rebuilds the pre-tokenizer from its
    own rules instead of reading the one in ``tokenizer.json``. For the project's tokenizer saved next to
    a tiny Qwen2 policy this silently changed how digits are split (single digits instead of groups of
    three), so a policy trained with one tokenization was run with another. Here the folder's
    ``tokenizer.json`` is the reference: if the class ``AutoTokenizer`` chose tokenizes differently, the
    file is loaded verbatim instead (``PreTrainedTokenizerFast``), chat template included."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(name_or_path)
    path = Path(name_or_path) / "tokenizer.json"
    if not path.is_file():
        return tok
    saved = json.loads(path.read_text(encoding="utf-8"))
    built = json.loads(tok.backend_tokenizer.to_str()) if hasattr(tok, "backend_tokenizer") else {}
    if all(built.get(k) == saved.get(k) for k in ("normalizer", "pre_tokenizer", "model")):
        return tok
    log.info("%s: %s rebuilds the tokenizer differently from tokenizer.json; loading the file as saved",
             name_or_path, type(tok).__name__)
    exact = PreTrainedTokenizerFast.from_pretrained(name_or_path)
    if exact.chat_template is None and tok.chat_template is not None:
        exact.chat_template = tok.chat_template
    return exact


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------

def tiny_qwen2_config(vocab_size: int = DEFAULT_VOCAB_SIZE, hidden_size: int = 256, num_layers: int = 4,
                      num_heads: int | None = None, num_kv_heads: int | None = None,
                      intermediate_size: int | None = None, max_position_embeddings: int = 32768,
                      tie_word_embeddings: bool = False, tokenizer=None):
    """A small Qwen2 configuration (same architecture as Qwen2.5-7B: GQA, SwiGLU, RMSNorm, RoPE).

    Heads default to ``hidden_size // 64`` so that the head dimension is 64 (vLLM's CPU attention
    rejects small head dimensions such as 16); KV heads to half of that (grouped-query attention).
    With the defaults (hidden 256, 4 layers, vocab 3072): about 4.7M parameters. ``tokenizer``, if
    given, sets the pad and end-of-sequence ids."""
    from transformers import Qwen2Config

    num_heads = num_heads or max(1, hidden_size // 64)
    num_kv_heads = num_kv_heads or max(1, num_heads // 2)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} ids but vocab_size={vocab_size}")
    ids = {}
    if tokenizer is not None:
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=None)
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tie_word_embeddings, use_sliding_window=False, **ids)


def qwen25_7b_config(vocab_size: int = 152064):
    """Qwen2.5-7B(-Instruct)'s published shape: hidden 3584, 28 layers, 28 heads, 4 KV heads,
    FFN 18944, vocabulary 152064, RoPE theta 1e6, untied embeddings (about 7.6B parameters)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


def build_model(config, seed: int = 0, dtype=None, device=None):
    """A ``Qwen2ForCausalLM`` with random weights drawn from ``seed`` (the same seed gives the same
    weights), in eval mode. Nothing is downloaded."""
    import torch
    from transformers import Qwen2ForCausalLM

    devices = [torch.device(device)] if device is not None and torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def previous_token_biases(config, offsets=(1, 2), n_pos: int = 2048, steps: int = 300, seed: int = 0):
    """Query biases (one per offset) and one key bias whose rotary attention scores, with zero
    query/key weights, put nearly all of position ``i``'s attention on position ``i - offset``.

    Fitted by gradient descent on the causal softmax over ``n_pos`` positions of ``config``'s RoPE
    (deterministic for a given ``seed``). Returns ``(q_biases (len(offsets), head_dim), k_bias
    (head_dim,), attention)`` where ``attention[n]`` is the smallest attention on ``i - offsets[n]``
    over all ``i >= offsets[n]``."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    if not offsets or min(offsets) < 1 or n_pos <= max(offsets):
        raise ValueError(f"offsets must be >= 1 and below n_pos={n_pos}, got {offsets}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pos = torch.arange(n_pos)[None]
    with torch.no_grad():
        cos, sin = Qwen2RotaryEmbedding(config)(torch.zeros(1, n_pos, head_dim), pos)
    gen = torch.Generator().manual_seed(seed)
    bq = torch.randn(len(offsets), head_dim, generator=gen).requires_grad_()
    bk = torch.randn(head_dim, generator=gen).requires_grad_()
    opt = torch.optim.Adam([bq, bk], lr=0.05)
    future = ~torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    rows = [torch.arange(o, n_pos) for o in offsets]

    def attention_logp():
        q = bq[None, :, None, :].expand(1, len(offsets), n_pos, head_dim)
        k = bk.expand(1, 1, n_pos, head_dim)
        qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
        scores = (qe @ ke.transpose(-1, -2))[0] * head_dim ** -0.5
        return scores.masked_fill(future, float("-inf")).log_softmax(-1)

    for _ in range(steps):
        logp = attention_logp()
        loss = -sum(logp[n, r, r - o].mean() for n, (o, r) in enumerate(zip(offsets, rows)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logp = attention_logp()
        attention = [float(logp[n, r, r - o].exp().min()) for n, (o, r) in enumerate(zip(offsets, rows))]
    return bq.detach(), bk.detach(), attention


def init_previous_token_heads(model, layer: int = 0, kv_head: int = 0, offsets=(1, 2), n_pos: int = 2048,
                              steps: int = 300) -> list[float]:
    """In a ``Qwen2ForCausalLM``, turn the query heads of one KV group of ``layer`` into previous-token heads: head ``n`` of
    the group attends to the token ``offsets[n]`` positions back, whatever the tokens are (zero
    query/key weights, biases from :func:`previous_token_biases`); values and output stay as they
    are. The group shares one key projection, which is replaced too: with fewer ``offsets`` than the
    group has query heads, the others keep their queries but meet position-only keys until training
    moves them. Returns the smallest attention on the target position, per head.

    Why: copying an id from the context needs an induction circuit (a previous-token head, then a
    head that matches the current token against what preceded each earlier token). A tiny model
    trained from scratch has to discover both at once and sits on a loss plateau first. How much these
    heads shorten it depends on the settings, measured on pure copy drills (hidden 128, 4 layers,
    tokens from 3,000 ids, 32 rows of 128 tokens, lr 2e-3, 2 threads): with AdamW betas (0.9, 0.999),
    one run each, random weights were still at loss 7.8 (ln 3000 = 8.0) after 1,400 steps while this
    initialisation left the plateau near step 400 and predicted 95 % of the repeats at step 1,000;
    with betas (0.9, 0.95) (``benchmarks/bench_copy_plateau.py``, biases fitted over 128 positions)
    both left it near step 950 (``data/copy_plateau_fit128.csv``). ``tests/test_sft.py`` checks
    the contrast on a smaller model."""
    import torch

    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if not 0 <= layer < cfg.num_hidden_layers:
        raise ValueError(f"layer must be in [0, {cfg.num_hidden_layers}), got {layer}")
    if not 0 <= kv_head < cfg.num_key_value_heads:
        raise ValueError(f"kv_head must be in [0, {cfg.num_key_value_heads}), got {kv_head}")
    if len(offsets) > group:
        raise ValueError(f"{len(offsets)} offsets but a KV group has {group} query heads")
    attn = model.model.layers[layer].self_attn
    if attn.q_proj.bias is None or attn.k_proj.bias is None:
        raise ValueError("the model's query/key projections have no biases (Qwen2's have)")
    bq, bk, attention = previous_token_biases(cfg, offsets, n_pos=n_pos, steps=steps)
    head_dim = bk.shape[0]
    with torch.no_grad():
        for n in range(len(offsets)):
            h = kv_head * group + n
            attn.q_proj.weight[h * head_dim:(h + 1) * head_dim] = 0
            attn.q_proj.bias[h * head_dim:(h + 1) * head_dim] = bq[n].to(attn.q_proj.bias.dtype)
        attn.k_proj.weight[kv_head * head_dim:(kv_head + 1) * head_dim] = 0
        attn.k_proj.bias[kv_head * head_dim:(kv_head + 1) * head_dim] = bk.to(attn.k_proj.bias.dtype)
    return attention


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Saved policies
# ----------------------------------------------------------------------------------------------------

class _SinkLogitsReport(logging.Filter):
    """Drops transformers' load report when the only keys it names are the learned sink logits, which
    the stock architecture does not have and :func:`load_policy` loads itself right after; any other
    key (missing, unexpected, mismatched) keeps the report."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" not in text:
            return True
        rows = [line for line in text.splitlines() if "|" in line and ("UNEXPECTED" in line or "MISSING" in line
                                                                     or "MISMATCH" in line)]
        return not rows or not all("sinkflex_sink_logits" in line and "UNEXPECTED" in line for line in rows)


@contextlib.contextmanager
def _quiet_about_sink_logits():
    log = logging.getLogger("transformers.modeling_utils")
    flt = _SinkLogitsReport()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


def hide_loading_bars() -> None:
    """Turn off transformers' own progress bars (loading and writing weights), for a command run with
    ``--no-progress`` whose log should hold only its own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def loading_bars(show: bool):
    """transformers' own progress bars (loading and writing weights) off inside the block when ``show``
    is false, as they were after it: a run with its progress off (``progress=False``) prints none of
    them, and the caller's setting outlives it."""
    from transformers.utils import logging as hf_logging

    hide = not show and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def load_policy(path: str | os.PathLike, *, base_model: str | None = None, dtype=None, device=None,
                attn_implementation: str | None = None, saved_attention: bool = True):
    """A saved policy folder as a transformers causal LM in eval mode, **with the attention it was
    trained with**: sink counts per layer, window and learned zero-value sink logits
    (:func:`sinkflex_core.attention.attention_settings`), on top of the weights.

    Plain ``from_pretrained`` loads such a folder with stock attention and drops the learned sink
    logits as unknown keys: the model it returns is not the one that was trained. The folder may hold
    a whole model (``config.json``) or LoRA adapters (``adapter_config.json``, as ``Trainer.export_policy``
    writes them, with ``sink_logits.safetensors`` beside them); adapters are loaded over ``base_model``
    (default: the base named in ``adapter_config.json``) and merged. A folder without sink settings
    loads as a plain model on ``attn_implementation`` (transformers' default when None); a folder with
    sink settings is switched to sink attention whatever ``attn_implementation`` says.

    ``saved_attention=False`` loads the same weights with full attention instead (on
    ``attn_implementation``, default ``"sdpa"``): sink counts, window and learned sink logits are dropped
    (:func:`sinkflex_core.attention.remove`); a folder saved with full attention is refused. That is
    another model than the one trained; use it to measure what the sink attention does to a policy, not
    to serve it."""
    from transformers import AutoModelForCausalLM

    from . import attention

    path = Path(path)
    adapters = path / "adapter_config.json"
    if not (path / "config.json").is_file() and not adapters.is_file():
        raise FileNotFoundError(f"{path}: no saved model there (neither config.json nor adapter_config.json)")
    settings = attention.attention_settings(path)
    if not saved_attention:
        if settings is None:
            raise ValueError(f"{path} was saved with full attention: saved_attention=False changes nothing")
        attn_implementation = attn_implementation or "sdpa"
        if attn_implementation == attention.IMPLEMENTATION:
            raise ValueError(f"saved_attention=False plays {path} with full attention: attn_implementation "
                             f"cannot be {attention.IMPLEMENTATION!r}")
    kwargs = {} if dtype is None else {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if adapters.is_file():
        from peft import PeftModel

        base = base_model or json.loads(adapters.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path} holds LoRA adapters without the name of their base model: pass base_model=")
        model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    else:
        with _quiet_about_sink_logits():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not saved_attention:  # settings is not None: refused above
        attention.remove(model, attn_implementation)  # config.json's sinkflex_* entries too
        settings = None
    if settings is not None:
        attention.apply(model, n_sink=settings["n_sink"], window=settings["window"],
                        layer_sinks=settings["layer_sinks"], learn_sinks=settings["learn_sinks"])
    if adapters.is_file():
        model = PeftModel.from_pretrained(model, path)
    if settings is not None and settings["learn_sinks"]:
        attention.load_sink_logits(model, path)
    if adapters.is_file():
        model = model.merge_and_unload()
    if device is not None:
        model = model.to(device)
    return model.eval()
