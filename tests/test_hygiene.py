"""Integration hygiene: `enable` touches only the one model and is undone by `disable`; nothing SSD-specific is
saved; pipelines pass `ssd_config` through; process state is left as found; and the package source uses no
unsafe loading or dynamic code."""

from __future__ import annotations

import ast
import copy
import gc
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from conftest import make_model, noisy_copy
from test_edges import text_of, tiny_tokenizer
from transformers import LlamaForCausalLM, pipeline
from transformers.generation.utils import GenerationMixin

import hf_ssd
from hf_ssd import SSDConfig

PROMPT = torch.tensor([[5, 6, 7, 8]])
PACKAGE = Path(hf_ssd.__file__).resolve().parent
QUIET = SSDConfig(hit_rate_warning=0.0)


def ssd(model, draft, **kw):
    kw.setdefault("max_new_tokens", 8)
    return model.generate(PROMPT, assistant_model=draft, do_sample=False, ssd_config=QUIET, **kw)


def rejects_ssd_config(model, draft) -> bool:
    try:
        ssd(model, draft)
    except ValueError as err:
        return "ssd_config" in str(err)
    return False


@pytest.fixture
def fresh():
    """A model of its own (not the shared `target`), and a draft for it."""
    model = make_model(0)
    return model, noisy_copy(model, 0.01)


# ----- enable / disable --------------------------------------------------------------------------------------------


def test_enable_is_idempotent(fresh):
    model, draft = fresh
    assert hf_ssd.enable(model) is model
    generate = model.generate
    assert hf_ssd.enable(model) is model
    assert model.generate is generate, "a second enable wrapped generate again"
    assert torch.equal(ssd(model, draft), model.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_disable_restores_the_model(fresh):
    model, draft = fresh
    before = set(vars(model))
    hf_ssd.enable(model)
    hf_ssd.disable(model)
    assert set(vars(model)) == before, "enable/disable left instance attributes behind"
    assert not hf_ssd.is_enabled(model)
    assert model.generate.__func__ is type(model).generate
    assert rejects_ssd_config(model, draft)
    hf_ssd.disable(model)  # a second disable, and a disable of a model never enabled, are no-ops
    hf_ssd.disable(make_model(1))
    hf_ssd.enable(model)  # and enable works again after disable
    assert torch.equal(ssd(model, draft), model.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_enable_changes_only_that_model(fresh):
    model, draft = fresh
    class_generate = LlamaForCausalLM.generate
    class_get = LlamaForCausalLM._get_candidate_generator
    sibling = make_model(0)
    hf_ssd.enable(model)
    assert LlamaForCausalLM.generate is class_generate is GenerationMixin.generate
    assert LlamaForCausalLM._get_candidate_generator is class_get
    assert not hf_ssd.is_enabled(sibling)
    assert "generate" not in vars(sibling)
    assert rejects_ssd_config(sibling, draft)
    # The sibling's own assisted generation still goes through transformers' candidate generator.
    out = sibling.generate(PROMPT, assistant_model=draft, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, model.generate(PROMPT, max_new_tokens=8, do_sample=False))
    assert hf_ssd.last_stats(sibling) is None


def test_enable_leaves_weights_and_configs_alone(fresh):
    model, draft = fresh
    config, gen_config = model.config.to_dict(), model.generation_config.to_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hf_ssd.enable(model)
    ssd(model, draft)
    assert model.config.to_dict() == config
    assert model.generation_config.to_dict() == gen_config
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    assert not any("ssd" in name.lower() for name, _ in model.named_modules())


def test_save_pretrained_writes_nothing_ssd_specific(fresh, tmp_path):
    model, draft = fresh
    hf_ssd.enable(model)
    ssd(model, draft)
    model.save_pretrained(tmp_path)
    jsons = list(tmp_path.glob("*.json"))
    assert {p.name for p in jsons} >= {"config.json", "generation_config.json"}
    for path in jsons:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
        assert "ssd" not in text.lower(), f"{path.name} mentions ssd"
    assert not [p for p in tmp_path.iterdir() if "ssd" in p.name.lower()]
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).double().eval()
    assert not hf_ssd.is_enabled(reloaded)
    assert torch.equal(reloaded.generate(PROMPT, max_new_tokens=8, do_sample=False),
                       model.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_deepcopy_of_enabled_model_generates_with_the_copy(fresh):
    model, draft = fresh
    hf_ssd.enable(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(-1.0)  # a different model now
    own = hf_ssd.disable(copy.deepcopy(clone)).generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(clone.generate(PROMPT, max_new_tokens=8, do_sample=False), own)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_models_are_not_kept_alive(static):
    """Both draft paths: the static one keeps its buffers per draft model, weakly (they go with the draft)."""
    model = hf_ssd.enable(make_model(0))
    draft = noisy_copy(model, 0.01)
    model.generate(PROMPT, assistant_model=draft, do_sample=False, max_new_tokens=8,
                   ssd_config=SSDConfig(hit_rate_warning=0.0, static_draft=static))
    assert hf_ssd.last_stats(model).draft_path == ("static" if static else "dynamic")
    refs = [weakref.ref(model), weakref.ref(draft)]
    del model, draft
    gc.collect()
    assert all(r() is None for r in refs), "hf_ssd holds a reference to a model after generate"


# ----- pipelines -------------------------------------------------------------------------------------------------


def test_text_generation_pipeline(fresh):
    model, draft = fresh
    hf_ssd.enable(model)
    tok = tiny_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, assistant_model=draft)
    prompt = text_of([5, 6, 7, 8])
    plain = pipe(prompt, max_new_tokens=8, do_sample=False)
    with_ssd = pipe(prompt, ssd_config=SSDConfig(hit_rate_warning=0.0), max_new_tokens=8, do_sample=False)
    assert with_ssd == plain
    assert hf_ssd.last_stats(model).new_tokens == 8
    alone = pipeline("text-generation", model=make_model(0), tokenizer=tok)
    assert alone(prompt, max_new_tokens=8, do_sample=False) == plain


# ----- process state ----------------------------------------------------------------------------------------------


def test_torch_threads_restored(target, draft):
    before = torch.get_num_threads()
    for layout in ("thread", "inline", "auto"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=8,
                        ssd_config=SSDConfig(layout=layout, cpu_threads=1, hit_rate_warning=0.0))
        assert torch.get_num_threads() == before, layout


def test_no_logging_configuration():
    assert all(isinstance(h, logging.NullHandler) for h in logging.getLogger("hf_ssd").handlers)
    assert logging.getLogger("hf_ssd").level == logging.NOTSET


def test_greedy_call_leaves_global_rng_alone(target, draft):
    torch.manual_seed(0)
    target.generate(PROMPT, max_new_tokens=8, do_sample=False)
    after_plain = torch.rand(4)
    torch.manual_seed(0)
    ssd(target, draft)
    assert torch.equal(torch.rand(4), after_plain)


# ----- security: the package source ------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
DYNAMIC_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def unsafe_uses(source: str, filename: str = "<src>") -> list[str]:
    """Unsafe deserialisation, remote code and dynamic code in `source`, as 'file:line: what' strings.

    Works on the syntax tree, so comments and docstrings that merely mention these do not count.
    """
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if isinstance(node.func, ast.Name) and name in DYNAMIC_BUILTINS:
                found.append(f"{where}: {name}()")
            if name.endswith("torch.load") or name == "load":  # also `from torch import load`
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where}: {name}() without weights_only=True")
            remote = _keyword(node, "trust_remote_code")
            if remote is not None and not (isinstance(remote, ast.Constant) and remote.value is False):
                found.append(f"{where}: trust_remote_code not False")
            if name.endswith(("np.load", "numpy.load")):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{where}: numpy load with allow_pickle")
            shell = _keyword(node, "shell")
            if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
                found.append(f"{where}: subprocess with shell=True")
            if name in ("os.system", "os.popen", "yaml.load", "yaml.unsafe_load"):
                found.append(f"{where}: {name}()")
    return found


def test_scanner_catches_unsafe_code():
    bad = (
        "import pickle\nfrom dill import loads\nimport torch\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\n"
        "m = f('x', trust_remote_code=True)\neval('1')\nexec('x = 1')\n"
        "subprocess.run('ls', shell=True)\nos.system('ls')\n"
    )
    flagged = {int(hit.split(":")[1]) for hit in unsafe_uses(bad)}
    assert flagged == {1, 2, 4, 5, 6, 7, 8, 9, 10}  # every line but `import torch`
    fine = (
        "'''pickle, eval( and trust_remote_code=True in a docstring'''\n# torch.load(x) in a comment\n"
        "model.eval()\ntorch.load('x', weights_only=True)\nf('x', trust_remote_code=False)\n"
        "subprocess.run(['pip', 'download'])\n"
    )
    assert unsafe_uses(fine) == []


def test_package_source_is_free_of_unsafe_code():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10
    found = [hit for path in files for hit in unsafe_uses(path.read_text(encoding="utf-8"), str(path))]
    assert not found, "\n".join(found)


def test_engine_never_imports_tooling():
    """The engine modules directly in hf_ssd/ import nothing from the tooling subpackages, and importing the
    package loads none of them (they pull in datasets, matplotlib, gguf...)."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import hf_ssd as pkg

    tooling = ("bench", "models", "cli")
    for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert not any(mod.lstrip(".").split(".")[0] == t or mod == f"hf_ssd.{t}" or
                               mod.startswith(f"hf_ssd.{t}.") for t in tooling), f"{path.name} imports {mod}"
    code = (
        "import sys, hf_ssd; print(sorted(m for m in sys.modules "
        f"if m.startswith('hf_ssd.') and m.split('.')[1] in {tooling!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
    assert callable(pkg.pairs.load_default_pair)  # the README's hf_ssd.pairs works after a plain import
