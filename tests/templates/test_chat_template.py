"""Chat templates render exactly as transformers' apply_chat_template: the goldens in
tests/fixtures/chat_templates/golden were produced by transformers 5.24 (see that folder's README)."""

import json
from pathlib import Path

import pytest

from bubo.templates.chat_template import ChatTemplate, ChatTemplateError

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"


def _cases() -> list[tuple[str, dict]]:
    cases = []
    for golden in sorted((TEMPLATES / "golden").glob("*.json")):
        data = json.loads(golden.read_text())
        entries = data["cases"] if isinstance(data, dict) and "cases" in data else data
        for case in entries.values() if isinstance(entries, dict) else entries:
            cases.append((golden.stem, case))
    return cases


@pytest.mark.parametrize(
    ("name", "case"), _cases(), ids=lambda v: v if isinstance(v, str) else v.get("name", "")
)
def test_renders_the_golden(name: str, case: dict) -> None:
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text())
    kwargs = dict(case.get("kwargs") or {})
    if "expected_error" in case:
        with pytest.raises(ChatTemplateError):
            template.render(case["messages"], tools=case.get("tools"), **kwargs)
    else:
        assert template.render(case["messages"], tools=case.get("tools"), **kwargs) == case["expected"]


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_every_template_renders_a_plain_chat(path: Path) -> None:
    template = ChatTemplate(path.read_text(), {"bos_token": "<s>", "eos_token": "</s>"})
    text = template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    )
    assert "Be brief." in text and "Hi there" in text


def test_tojson_keeps_key_order_and_unicode_unescaped() -> None:
    template = ChatTemplate("{{ messages[0] | tojson }}")
    assert template.render([{"role": "user", "content": "é <b>"}], add_generation_prompt=False) == (
        '{"role": "user", "content": "é <b>"}'
    )


def test_the_sandbox_refuses_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_the_sandbox_is_immutable() -> None:
    template = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_raise_exception_is_a_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('no system role here') }}")
    with pytest.raises(ChatTemplateError, match="no system role here"):
        template.render([{"role": "user", "content": "x"}])


def test_a_syntax_error_is_reported_with_its_line() -> None:
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% for %}")


def test_the_fallback_is_chatml() -> None:
    text = ChatTemplate.fallback().render([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_thinking_support_is_detected() -> None:
    assert ChatTemplate((TEMPLATES / "Qwen3.jinja").read_text()).supports_thinking
    assert not ChatTemplate((TEMPLATES / "SmolLM2-Instruct.jinja").read_text()).supports_thinking
