"""Write docs/plugin_hooks.md, the hook reference, from ddpx/plugin/hookspecs.py: ``python docs/make_plugin_hooks_md.py``.

tests/test_docs.py fails when the committed file differs from what this makes.
"""

import inspect
import os
import re

from ddpx.plugin import hookspecs

HOOKS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin_hooks.md")



def _kind(name: str) -> str:
    opts = getattr(hookspecs, name).ddpx_spec
    return "first result" if opts.get("firstresult") else "every plugin"


def _markdown_doc(text: str) -> str:
    """reST inline markup to Markdown: ``x`` -> `x`, :func:`x` -> `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def reference_markdown() -> str:
    """docs/plugin_hooks.md: every hook with its signature and docstring, in the order of
    ddpx/plugin/hookspecs.py, the hook order and the trainer's attributes and methods."""
    out = [
        "# Hook reference",
        "",
        "<!-- Generated from ddpx/plugin/hookspecs.py by `python docs/make_plugin_hooks_md.py`;",
        "     tests/test_docs.py fails when this file is stale. Edit ddpx/plugin/hookspecs.py, not this file. -->",
        "",
        "Every hook a ddpx plugin can implement, in the order of a run. Kinds: *every plugin* "
        "(each implementation is called; results are collected), *first result* (the first "
        "implementation returning something other than `None` wins; the trainer's default runs last), "
        "*wrapper* (implement with `@hookimpl(wrapper=True)` as a generator that yields once). "
        "Writing a plugin, and the built-in plugins: [plugins.md](plugins.md).",
        "",
        "## The order of the hooks",
        "",
        "```",
        hookspecs.HOOK_ORDER,
        "```",
        "",
        "## The hooks",
        "",
    ]
    section = None
    for name in _hooks_in_source_order(inspect.getsource(hookspecs)):
        fn = getattr(hookspecs, name)
        heading = _SECTIONS.get(name)
        if heading and heading != section:
            section = heading
            out += [f"### {heading}", ""]
        params = ", ".join(inspect.signature(fn).parameters)
        doc = _markdown_doc(inspect.cleandoc(fn.__doc__ or ""))
        out += [f"#### `{name}({params})`", "", f"*{_kind(name)}*", "", doc, ""]
    out += ["## What a plugin may use on the trainer", "",
            "Attributes of `trainer` (a `ddpx.train.trainer.Trainer`):", ""]
    out += [f"- `{name}`: {_markdown_doc(text)}" for name, text in hookspecs.TRAINER_ATTRIBUTES.items()]
    out += ["", "Methods:", ""]
    out += [f"- `trainer.{name}`: {_markdown_doc(text)}" for name, text in hookspecs.TRAINER_METHODS.items()]
    out += ["", "The lifecycle that `ddpx train`, the smoke run and the benchmarks drive, in this order:", ""]
    out += [f"- `trainer.{name}`: {_markdown_doc(text)}" for name, text in hookspecs.TRAINER_LIFECYCLE.items()]
    return "\n".join(out) + "\n"


_SECTIONS = {
    "ddpx_config_defaults": "Configuration and set-up",
    "ddpx_train_start": "The loop",
    "ddpx_state_dict": "Checkpoints",
}


def _hooks_in_source_order(source: str) -> list:
    return re.findall(r"^def (ddpx_\w+)\(", source, flags=re.M)


if __name__ == "__main__":
    with open(HOOKS_MD, "w") as f:
        f.write(reference_markdown())
