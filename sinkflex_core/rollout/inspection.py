"""Looking at a trajectory: whether its ids match the chat template applied to its conversation
(:func:`check_template_consistency`), and its tokens coloured by where they came from
(:func:`trajectory_html`)."""

from __future__ import annotations

from dataclasses import dataclass

from .collect import ChatDelta, _template_text
from .trajectory import Trajectory


@dataclass
class TemplateCheck:
    """Outcome of :func:`check_template_consistency`.

    ``kind`` is None when the ids are equal, ``"text"`` when the template renders a different text
    (e.g. the model's tool-call JSON is spaced differently from the template's rendering of the parsed
    call, or text precedes a tool call), ``"tokens"`` when the text is the same but split into other
    tokens (a model may emit a sequence the tokenizer would merge)."""

    equal: bool
    kind: str | None
    first_mismatch: int | None
    n_ours: int
    n_template: int
    ours: str = ""
    template: str = ""

    def __str__(self) -> str:
        if self.equal:
            return f"equal ({self.n_ours} tokens)"
        return (f"differ ({self.kind}) at {self.first_mismatch} of {self.n_ours}/{self.n_template} tokens: "
                f"ours {self.ours!r} vs template {self.template!r}")


def check_template_consistency(traj: Trajectory, tokenizer, context: int = 30) -> TemplateCheck:
    """Compare a trajectory's ids, assembled turn by turn, with the chat template applied to its final
    conversation (and tokenized in one go)."""
    msgs = traj.messages
    ends_with_assistant = msgs[-1]["role"] == "assistant"
    text = _template_text(tokenizer, msgs, traj.tools, add_generation_prompt=not ends_with_assistant)
    if ends_with_assistant:
        # The trajectory stops at the assistant's end token (or before it, if the turn was cut).
        delta = ChatDelta(tokenizer, traj.tools)
        tail = delta.after_eot
        ended_on_eot = traj.input_ids and tokenizer.convert_ids_to_tokens(traj.input_ids[-1]) == delta.eot
        if not ended_on_eot:
            tail = delta.eot + tail
        if text.endswith(tail):
            text = text[: len(text) - len(tail)]
    ref = tokenizer.encode(text, add_special_tokens=False)
    ours = list(traj.input_ids)
    if ours == ref:
        return TemplateCheck(True, None, None, len(ours), len(ref))
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    ours_text = tokenizer.decode(ours, skip_special_tokens=False)
    kind = "tokens" if ours_text == text else "text"
    if kind == "text":
        j = next((k for k, (a, b) in enumerate(zip(ours_text, text)) if a != b), min(len(ours_text), len(text)))
        a, b = ours_text[max(0, j - context): j + context], text[max(0, j - context): j + context]
    else:
        a = " | ".join(tokenizer.convert_ids_to_tokens(ours[max(0, i - 3): i + 3]))
        b = " | ".join(tokenizer.convert_ids_to_tokens(ref[max(0, i - 3): i + 3]))
    return TemplateCheck(False, kind, i, len(ours), len(ref), a, b)


# ----------------------------------------------------------------------------------------------------
# Showing a trajectory
# ----------------------------------------------------------------------------------------------------

TOKEN_COLOURS = {"prompt": "#e8e8e8", "env": "#d4e4ff", "policy": "#c9f2c7"}
_CSS = ("<style>.sfx-tok span{border-right:1px solid #fff;white-space:pre-wrap}"
        + "".join(f".sfx-tok .{k}{{background:{c}}}" for k, c in TOKEN_COLOURS.items()) + "</style>")


def trajectory_html(traj: Trajectory, tokenizer, max_tokens: int | None = None, show_prompt: bool = False) -> str:
    """The trajectory's tokens as HTML, one box per token, coloured by origin: policy (generated,
    loss mask 1), environment (tool results and customer messages) and prompt. Hovering a policy
    token shows its sampling log-prob."""
    import html

    start = 0 if show_prompt else traj.prompt_len
    ids = traj.input_ids[start:]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    parts = []
    for k, tid in enumerate(ids):
        i = start + k
        kind = "policy" if traj.loss_mask[i] else ("prompt" if i < traj.prompt_len else "env")
        text = tokenizer.decode([tid], skip_special_tokens=False)
        shown = html.escape(text).replace("\n", "&#9166;<br>") or "&#8203;"
        tip = f' title="{traj.logprobs[i]:.2f}"' if kind == "policy" else ""
        parts.append(f'<span class="{kind}"{tip}>{shown}</span>')
    more = len(traj.input_ids) - start - len(ids)
    tail = f" <i>... {more} more tokens</i>" if more > 0 else ""
    return (_CSS + '<div class="sfx-tok" style="font-family:monospace;font-size:11px;line-height:1.5">'
            + "".join(parts) + tail + "</div>")


def legend_html() -> str:
    return " ".join(f'<span style="background:{c};padding:1px 6px;font-family:monospace">{k}</span>'
                    for k, c in TOKEN_COLOURS.items()) + " (hover a policy token for its sampling log-prob)"
