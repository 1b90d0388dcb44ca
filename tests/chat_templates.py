"""Chat templates for tokenizers the tests build locally (no hub on these machines)."""

#: Qwen3's rule for the generation prompt, reproduced for a locally built tokenizer (no hub here):
#: ChatML turns, then ``<|im_start|>assistant\n``, then an empty think block when the caller passes
#: ``enable_thinking=False`` (Qwen3 model card, "non-thinking mode").
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
