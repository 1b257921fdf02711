"""Ollama's Go chat templates translated to Jinja (core.gotemplate), rendered here with Python's
Jinja configured as llama.cpp renders chat templates (trim_blocks, lstrip_blocks): the output
must be what Ollama renders. tests/test_llamacpp_native.py renders some through a real runner."""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import pytest

from corral.core.gotemplate import TemplateError, is_jinja, to_jinja

ENV = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
ENV.globals["strftime_now"] = lambda fmt: datetime.date.today().strftime(fmt)
ENV.filters["tojson"] = lambda x: json.dumps(x, separators=(",", ":"))


def render(go: str, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    return ENV.from_string(to_jinja(go)).render(
        messages=messages, tools=tools, add_generation_prompt=True
    )


def conv(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"role": r, "content": c} for r, c in pairs]


CHAT = conv(("user", "Hi!"), ("assistant", "Hello."), ("user", "Name?"))
SYS_CHAT = conv(("system", "Be brief."), *((m["role"], m["content"]) for m in CHAT))


def test_a_messages_template_renders_every_turn() -> None:
    chatml = (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n"
    )
    assert render(chatml, SYS_CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Go trims with {{- and -}} (every space and newline beside them); other newlines stay,
    # even right after a block (where trim_blocks would eat them in raw Jinja text).
    llama3 = (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>\n{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(llama3, conv(("user", "Hi!"))) == (
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_system_index_and_last_as_gemma3_writes_them() -> None:
    gemma3 = (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
        '{{- if eq .Role "user" }}<start_of_turn>user\n'
        "{{- if and (eq $i 1) $.System }}\n{{ $.System }}\n{{ end }}\n"
        "{{ .Content }}<end_of_turn>\n"
        '{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n'
        "{{ end }}\n{{- if $last }}<start_of_turn>model\n{{ end }}\n{{- end }}"
    )
    assert render(gemma3, SYS_CHAT) == (
        "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName?<end_of_turn>\n<start_of_turn>model\n"
    )
    # .System is every system message, joined by a blank line
    two = conv(("system", "A."), ("system", "B."), ("user", "x"))
    assert render("{{ .System }}|{{ range .Messages }}{{ .Role }} {{ end }}", two) == (
        "A.\n\nB.|system system user "
    )


def test_variables_assigned_in_a_range_outlive_it_and_printf_joins() -> None:
    alpaca = (
        '{{- $system := "" }}{{- range .Messages }}{{- if eq .Role "system" }}'
        "{{- if not $system }}{{ $system = .Content }}"
        '{{- else }}{{ $system = printf "%s\\n\\n%s" $system .Content }}{{- end }}'
        '{{- else if eq .Role "user" }}{{- if $system }}{{ $system }}\n\n'
        '{{ $system = "" }}{{- end }}### Instruction:\n{{ .Content }}\n\n'
        '{{ else if eq .Role "assistant" }}### Response:\n{{ .Content }}\n\n'
        "{{ end }}{{- end }}### Response:\n"
    )
    msgs = conv(("system", "S1"), ("system", "S2"), ("user", "Hi!"), ("assistant", "Yo"))
    assert render(alpaca, msgs) == (
        "S1\n\nS2\n\n### Instruction:\nHi!\n\n### Response:\nYo\n\n### Response:\n"
    )


def test_continue_skips_the_rest_of_an_iteration_and_keeps_what_it_wrote() -> None:
    falcon = (
        '{{- range .Messages }}{{- if eq .Role "system" }}System: {{ .Content }}\n'
        '{{ continue }}{{- else if eq .Role "user" }}User:'
        '{{- else if eq .Role "assistant" }}Falcon:{{- end }}\n{{ .Content }}\n{{ end }}Falcon:\n'
    )
    assert render(falcon, SYS_CHAT) == (
        "System: Be brief.\nUser:\nHi!\nFalcon:\nHello.\nUser:\nName?\nFalcon:\n"
    )
    with pytest.raises(TemplateError, match="continue"):
        to_jinja("{{ continue }}")


def test_tools_and_tool_calls_print_as_ollama_prints_them() -> None:
    go = (
        "{{- range .Tools }}{{ .Function.Name }}("
        "{{ range $name, $p := .Function.Parameters.Properties }}{{ $name }}: {{ $p.Type }}, "
        "{{ end }}) {{ json .Function.Parameters.Required }}\n{{ . }}\n{{ end }}"
        "{{- range .Messages }}<{{ .Role }}>{{ if .ToolCalls }}{{ range .ToolCalls }}"
        "{{ .Function.Name }} {{ .Function.Arguments }}{{ end }}{{ else }}{{ .Content }}"
        "{{ end }}</{{ .Role }}>{{ end }}"
    )
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"zcity": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["zcity"]}}}  # fmt: skip
    msgs = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"zcity": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]  # fmt: skip
    out = render(go, msgs, [tool])
    # a map ranges in key order, as in Go; objects print as JSON
    assert out.startswith('weather(days: integer, zcity: string, ) ["zcity"]\n{"type":"function"')
    assert out.endswith(
        '<user>Paris?</user><assistant>weather {"zcity":"Paris"}</assistant><tool>sunny</tool>'
    )


LEGACY = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] "


@pytest.mark.parametrize("template", [LEGACY, LEGACY + "{{ .Response }}"])
def test_a_legacy_template_renders_each_round(template: str) -> None:
    """Without .Messages Ollama renders the template once per round (.System, .Prompt,
    .Response), the last one cut after .Response; one without .Response gets it appended."""
    assert render(template, CHAT) == "[INST] Hi![/INST] Hello.[INST] Name?[/INST] "
    assert render(template, SYS_CHAT) == (
        "[INST] Be brief.\n\nHi![/INST] Hello.[INST] Name?[/INST] "
    )
    # an assistant message last: the answer continues it
    prefill = [*CHAT, {"role": "assistant", "content": "I am"}]
    assert render(template, prefill) == "[INST] Hi![/INST] Hello.[INST] Name?[/INST] I am"


def test_a_legacy_template_cut_after_the_response_it_is_writing() -> None:
    chatml = (
        "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
        "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n"
    )
    assert render(chatml, SYS_CHAT) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # consecutive user messages are one prompt, as Ollama collates them
    assert render(chatml, conv(("user", "a"), ("user", "b"))) == (
        "<|im_start|>user\na\n\nb<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ('{{ template "x" }}', "template"),
        ("{{ html .Prompt }}", "html"),
        ("{{ if .System }}open", "not closed"),
        ("text{{ end }}", "without a block"),
        ("{{ $nope }}", "undefined variable"),
        ("{{ .Nope }}", "unknown field .Nope"),
        ("{{ .System | }}", "empty"),
        ("{{/* unclosed }}", "comment"),
        ("{{ printf .System }}", "literal format"),
    ],
)
def test_what_cannot_be_translated_is_refused_by_name(template: str, error: str) -> None:
    with pytest.raises(TemplateError, match=error):
        to_jinja(template)


def test_jinja_is_told_from_go() -> None:
    assert is_jinja("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert is_jinja("{{ bos_token }}{{ messages[0].content }}")
    assert not is_jinja("{{ .System }} USER: {{ .Prompt }} ASSISTANT:")
    assert not is_jinja("{{- range .Messages }}{{ .Content }}{{ end }}")


def test_render_renders_a_request_template_here() -> None:
    """Ollama's generate `template` is rendered by corral (a runner renders only its own)."""
    from corral.core.gotemplate import render

    assert render(LEGACY, SYS_CHAT) == "[INST] Be brief.\n\nHi![/INST] Hello.[INST] Name?[/INST] "
    jinja = "{% for m in messages %}{{ m.content }};{% endfor %}"
    assert render(jinja, CHAT) == "Hi!;Hello.;Name?;"
    with pytest.raises(TemplateError):
        render("{{ html .Prompt }}", CHAT)
    with pytest.raises(TemplateError):  # the sandbox: no reaching into Python from a template
        render("{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}", CHAT)
