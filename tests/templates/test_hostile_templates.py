"""Hostile chat templates: reaching Python internals, reading files, endless loops, deep recursion and
huge values all end in a clear TemplateSandboxError, quickly, without the memory a naive render would
take; ordinary templates are unaffected (test_transformers_parity.py and test_chat_template.py)."""

import gc
import resource
import time

import pytest

from bubo.templates.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ConversationTooLargeError,
    RenderLimits,
    TemplateSandboxError,
)

HELLO = [{"role": "user", "content": "hello"}]
FAST = RenderLimits(seconds=0.5)
# "Quickly" is judged by the CPU time the process spent, which another process on a busy machine (the
# suite's second worker compiling kernels) cannot inflate; the wall-clock bound only catches a render that
# was never stopped, as each of these would otherwise run for minutes or until memory ran out.
STALL_SECONDS = 10.0


INTERNALS = {
    "class mro": "{{ ''.__class__.__mro__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals of a macro": "{% macro m() %}{% endmacro %}{{ m.__globals__ }}",
    "function globals": "{{ raise_exception.__globals__ }}",
    "namespace internals": "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}",
    "cycler internals": "{{ cycler.__init__.__globals__['os'] }}",
    "joiner internals": "{{ joiner.__init__.__globals__ }}",
    "dict internals": "{{ dict.__call__.__globals__ }}",
    "format attribute": "{{ '{0.__class__.__mro__}'.format('') }}",
    "self": "{{ self.__init__.__globals__ }}",
    "mutating a list": "{% set l = [1] %}{{ l.append(2) }}",
    "mutating a dict": "{% set d = {} %}{{ d.update({'a': 1}) }}",
}

FILES_AND_IMPORTS = {
    "import": "{% import 'os' as os %}{{ os }}",
    "include": "{% include '/etc/passwd' %}",
    "extends": "{% extends '/etc/passwd' %}",
    "from import": "{% from '/etc/passwd' import x %}",
}

RUNAWAYS = {
    "range too big": "{% for i in range(10**12) %}x{% endfor %}",
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "nested loops over a string": (
        "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    ),
    "string repeat": "{{ 'x' * 10**10 }}",
    "list repeat": "{{ ([1] * 10**10)|length }}",
    "power": "{{ 10**(10**10) }}",
    "squaring in a loop": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
    ),
    "concat doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    ),
    "plus doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    ),
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "center filter": "{{ 'x'|center(10000000000) }}",
    "indent filter": "{{ 'x\ny'|indent(10**10) }}",
    "percent width": "{{ '%10000000000d' % 1 }}",
    "percent star": "{{ '%*d' % (10**10, 1) }}",
    "format width": "{{ '{:>10000000000}'.format(1) }}",
    "nested format width": "{{ '{:{}}'.format(1, 10**10) }}",
    "format filter": "{{ '%10000000000s'|format('x') }}",
    "join": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}",
    "str join": "{% set s = 'x' * 1000000 %}{{ ''.join([s] * 1000) }}",
    "replace": "{% set s = 'x' * 10000 %}{{ s.replace('', s) }}",
    "replace filter": "{% set s = 'x' * 10000 %}{{ s|replace('', s) }}",
    "output": "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": ("{% set tree = [[[]]] %}{% for node in tree recursive %}{{ loop(tree) }}{% endfor %}"),
    "cycler loop": (
        "{% set c = cycler(1, 2) %}{% for i in range(99999) %}{% for j in range(99999) %}"
        "{{ c.next() and '' }}{% endfor %}{% endfor %}"
    ),
    "tojson indent": "{{ messages|tojson(indent=10**10) }}",
}


# Values written out as text far larger than the values themselves: each would be 400 MB or more,
# built before the size checks ran (issue 34).
HUGE_TEXT = {
    "percent format": "{% set big = 'x' * 10000000 %}{{ ('%s' * 40) % ((big,) * 40) }}",
    "join with a non-string item": "{% set big = 'x' * 10000000 %}{{ ([big] * 40 + [1])|join }}",
    "string filter": "{% set big = ['x' * 10000000] * 40 %}{{ big|string }}",
    "str.format of a list": "{% set big = ['x' * 10000000] * 40 %}{{ '{}'.format(big) }}",
    "format_map": "{% set big = ['x' * 10000000] * 40 %}{{ '{a}{a}'.format_map({'a': big}) }}",
    "tojson with a long indent": "{{ ([[1]] * 100000)|tojson(indent='x' * 2000) }}",
    "tojson with long separators": "{{ ([1] * 100000)|tojson(separators=('x' * 4000, ':')) }}",
    "output of a list": "{% set big = ['x' * 10000000] * 40 %}{{ big }}",
    "concat of a list": "{% set big = ['x' * 10000000] * 40 %}{{ 'a' ~ big }}",
    "escape": "{% set big = '&' * 15000000 %}{{ big|e|length }}",
}


def _render(source: str) -> str:
    return ChatTemplate(source, limits=FAST).render(HELLO)


def _render_timed(source: str) -> tuple[BaseException, float, float, float]:
    """The error rendering `source` raised, the CPU and wall seconds it took, and the MiB the process
    peak grew by."""
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # What earlier tests in this worker left on the heap is frozen: a full collection over it (inductor's
    # compiles leave millions of objects) is no part of the render's cost.
    gc.freeze()
    try:
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        with pytest.raises(TemplateSandboxError, match="chat template") as caught:
            _render(source)
        cpu, wall = time.process_time() - cpu_started, time.perf_counter() - wall_started
    finally:
        gc.unfreeze()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    return caught.value, cpu, wall, grown_mib


@pytest.mark.parametrize("source", INTERNALS.values(), ids=INTERNALS.keys())
def test_python_internals_are_out_of_reach(source: str) -> None:
    # The sandbox either refuses (an error naming the template) or hands back an undefined value that
    # prints as nothing: what matters is that nothing of Python's internals comes out.
    try:
        text = _render(source)
    except ChatTemplateError as error:
        assert "chat template" in str(error)
    else:
        assert text == ""


@pytest.mark.parametrize("source", FILES_AND_IMPORTS.values(), ids=FILES_AND_IMPORTS.keys())
def test_templates_cannot_load_files(source: str) -> None:
    # No loader: every template name is unknown, so nothing on disk is ever opened.
    with pytest.raises(ChatTemplateError, match=r"no loader|TemplateNotFound|not found"):
        _render(source)


@pytest.mark.parametrize("source", RUNAWAYS.values(), ids=RUNAWAYS.keys())
def test_runaway_templates_stop_quickly_with_a_clear_error(source: str) -> None:
    error, cpu, wall, grown_mib = _render_timed(source)
    assert cpu < FAST.seconds * 3, f"stopped after {cpu:.1f} s of CPU time"
    assert wall < STALL_SECONDS, f"stopped after {wall:.1f} s"
    assert grown_mib < 512, f"the process peak grew by {grown_mib:.0f} MiB"
    assert "Traceback" not in str(error)


@pytest.mark.parametrize("source", HUGE_TEXT.values(), ids=HUGE_TEXT.keys())
def test_values_written_out_as_text_are_sized_before_they_are_built(source: str) -> None:
    """Refused from the size the text will have: quickly, and with no more memory than the inputs."""
    _, cpu, wall, grown_mib = _render_timed(source)
    assert cpu < FAST.seconds * 2, f"stopped after {cpu:.1f} s of CPU time"
    assert wall < STALL_SECONDS, f"stopped after {wall:.1f} s"
    assert grown_mib < 64, f"the process peak grew by {grown_mib:.0f} MiB"


def test_a_template_that_stops_leaves_the_next_render_working() -> None:
    with pytest.raises(TemplateSandboxError):
        _render(RUNAWAYS["nested loops over a string"])
    assert _render("{% for m in messages %}[{{ m.content }}]{% endfor %}") == "[hello]"


def test_limits_leave_ordinary_large_work_alone() -> None:
    source = "{% for i in range(20000) %}{{ i|string|center(8) }}{% endfor %}{{ ('ab' * 100000)|length }}"
    text = ChatTemplate(source).render(HELLO)
    assert text.endswith("200000") and len(text) == 8 * 20000 + 6


def test_large_numbers_are_not_mistaken_for_sizes() -> None:
    source = (
        "{{ '%d' % 1700000000 }} {{ 10000000000|string }} {{ 9007199254740991|tojson }} "
        "{{ namespace(n=10**12).n }} {{ '{}'.format(10**12) }} {{ (2**62)|string|length }}"
    )
    assert ChatTemplate(source).render(HELLO) == (
        "1700000000 10000000000 9007199254740991 1000000000000 1000000000000 19"
    )


def test_a_template_too_deeply_nested_to_compile_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="chat template"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


def test_a_template_own_error_is_the_conversation_s_fault_not_the_sandbox_s() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate") as caught:
        template.render(HELLO)
    assert not isinstance(caught.value, TemplateSandboxError)


def test_a_conversation_that_is_itself_too_large_is_the_requests_fault() -> None:
    """A render limit reached by the size of the conversation alone is not the template's failure."""
    template = ChatTemplate.fallback()
    small = ChatTemplate(template.source, limits=RenderLimits(max_chars=10_000))
    with pytest.raises(ConversationTooLargeError, match="shorten it"):
        small.render([{"role": "user", "content": "x" * 12_000}])
    hurried = ChatTemplate(template.source, limits=RenderLimits(seconds=0.01))
    with pytest.raises(ConversationTooLargeError):
        hurried.render([{"role": "user", "content": "hi"}] * 200_000)
    # A template that blows up a small conversation is still the template's fault.
    runaway = ChatTemplate("{{ messages[0].content * 10**9 }}", limits=RenderLimits(max_chars=10_000))
    with pytest.raises(TemplateSandboxError):
        runaway.render(HELLO)
