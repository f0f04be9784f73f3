"""mergekit 0.1.5's named chat templates (`chat_template: chatml` in a merge YAML), written here in our own Jinja.

Each renders a conversation through transformers' apply_chat_template (trim_blocks, lstrip_blocks) exactly as
mergekit's template file of that name does, its whitespace included (exaone's indentation and alpaca's missing blank
line before a generation prompt are mergekit's renderings, kept so a merge here and there tokenize the same).
tests/unit/test_mergekit_yaml.py compares the renderings with pinned ones made from mergekit's files
(scripts/mergekit_reference.py). The formats are the public ChatML, Llama 3, Mistral [INST], Alpaca and EXAONE ones.
"""
from __future__ import annotations

CHAT_TEMPLATES = {
    "alpaca": (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages if m['role'] == 'system' %}{% set ns.system = m['content'] | trim %}{% endfor %}"
        "{{ ns.system + '\\n\\n' }}"
        "{% set heads = {'user': '### Instruction:\\n', 'assistant': '### Response:\\n',"
        " 'user_context': '### Input:\\n'} %}"
        "{% for m in messages %}{% if m['role'] in heads %}"
        "{{ heads[m['role']] + m['content'] | trim }}{% if not loop.last %}{{ '\\n\\n' }}{% endif %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}{{ '### Response:\\n' }}{% endif %}"),
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "exaone": (
        "{% for m in messages %}"
        "{% if loop.first and m['role'] != 'system' %}{{ '        [|system|][|endofturn|]\\n\\n' }}{% endif %}"
        "{{ '    [|' + m['role'] + '|]' + m['content'] + '\\n' }}"
        "{{ '        \\n\\n' if m['role'] == 'user' else '        [|endofturn|]\\n\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '    [|assistant|]\\n' }}{% endif %}"),
    "llama3": (
        "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}"),
    "mistral": (
        "{% set skip = 1 if messages[0]['role'] == 'system' else 0 %}"
        "{{ bos_token }}"
        "{% for m in messages[skip:] %}"
        "{% if (m['role'] == 'user') != (loop.index0 is even) %}"
        "{{ raise_exception('After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}"
        "{% if m['role'] == 'user' and loop.first and skip %}"
        "{{ ' [INST] ' + messages[0]['content'] + '\\n\\n' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'user' %}{{ ' [INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported, with the exception of an "
        "initial optional system message!') }}{% endif %}"
        "{% endfor %}"),
}


def named_template(value: str) -> str | None:
    """The template a YAML's chat_template names, as mergekit reads a name (short, one line, no `{`), else None."""
    if len(value) < 256 and "\n" not in value and "{" not in value:
        return CHAT_TEMPLATES.get(value)
    return None
