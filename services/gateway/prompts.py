"""Turn request bodies into prompt token ids with the served model's tokenizer (chat template applied),
so routing and limits count exactly what the engine will prefill."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import bad_request

from .schemas import ChatCompletionRequest, CompletionRequest

# Texts up to this length are tokenized by the Rust tokenizer's single call, which holds the GIL (a few hundred
# microseconds at most); longer ones by its batch call, which releases it (on the CPU pool, other threads run meanwhile).
SMALL_TEXT_CHARS = 8 * 1024
BATCHED_PROMPTS = "send one prompt per request (batched prompts are not supported; use n for several completions)"


class Prompter:
    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.vocab_size = len(self.tokenizer)
        # The Rust tokenizer itself, when there is one: it skips the wrapper's batching (a thread pool per call),
        # which costs more than the tokenization of a short prompt. Its batch calls release the GIL (its single
        # ones hold it: 1.5 s for 1 MB of text, during which no other thread of the process runs), so the gateway's
        # CPU pool tokenizes while the event loop serves.
        self._fast = getattr(self.tokenizer, "_tokenizer", None)
        # The wrapper's decode is the Rust one's unless it cleans up spaces afterwards.
        self._fast_decode = self._fast is not None and not self.tokenizer.clean_up_tokenization_spaces
        # apply_chat_template rebuilds the special-token map on every call (slower than rendering the
        # template): render with the same transformers function and a map built once.
        self._chat_template = self.tokenizer.get_chat_template() if self.tokenizer.chat_template else None
        self._template_kwargs = dict(self.tokenizer.special_tokens_map)
        try:
            from transformers.utils.chat_template_utils import render_jinja_template

            self._render = render_jinja_template
        except ImportError:  # another transformers layout: the public API does the same work
            self._render = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The chat template's text, as vLLM renders it (tools and chat_template_kwargs reach the template)."""
        extra = dict(template_kwargs or {})
        if self._render is None or self._chat_template is None:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      continue_final_message=continue_final_message, tools=tools, **extra)
        rendered, _ = self._render(conversations=[messages], chat_template=self._chat_template, tools=tools,
                                   add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                                   **(self._template_kwargs | extra))
        return rendered[0]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast is not None:
            if len(text) <= SMALL_TEXT_CHARS:  # the batch call's thread hand-off costs more than such a text's tokens
                return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
            return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat(self, req: ChatCompletionRequest) -> list[int]:
        return self.chat_messages(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                                  req.chat_template_kwargs)

    def chat_messages(self, messages, add_generation_prompt: bool = True, continue_final_message: bool = False,
                      tools=None, template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        try:
            text = self.render_chat([m.for_template() for m in messages], add_generation_prompt, continue_final_message,
                                    [t.model_dump(exclude_none=True) for t in tools] if tools else None, template_kwargs)
        except Exception as e:  # the template rejects the conversation (roles out of order, ...)
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._fast_decode:
            return self._fast.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def completion(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(BATCHED_PROMPTS, param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", param="prompt")
            return self.encode(prompt, add_special_tokens=True)
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(prompt)


def max_model_len(model: str, engine_args: dict) -> int | None:
    """The pool's context length: engine_args.max_model_len, else the local checkpoint's own limit."""
    if engine_args.get("max_model_len"):
        return int(engine_args["max_model_len"])
    config = Path(model) / "config.json"
    if config.exists():
        return json.loads(config.read_text()).get("max_position_embeddings")
    return None
