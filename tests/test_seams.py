"""The seams hold: the layers import only downwards (planning loads no library), no module imports
another that imports it back, the sidecar's units share their helpers without circles, counters and
policies are declared once (csrc/empanel.h) and every face plans once."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "empanel_gguf"

# The layers are the package's folders; every other module (llama, server, cli, commands/, ...) is
# a face. planning/ (pure Python over the model's header and our cache files) stands below engine/
# (the native seam and what runs on it), which stands below the faces; lab/ stands beside the
# engine, models/ (the writers) on planning's GGUF reader.
LAYERS = ("planning", "engine", "lab", "models")
NATIVE = "empanel_gguf.engine.native"  # the one module that opens our libraries
DROP_IN = "empanel_gguf.llama"  # the face the lab runs (the benchmark's child measures it)


def _modules():
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name, path, mods, top_level_only):
    """The package's modules that `name` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        # the package itself (`from . import x`) is not an edge: x is
        found |= {c for c in candidates if c in mods and c not in (name, "empanel_gguf")}
    return found


def _reach(graph, start):
    seen, stack = set(), [start]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "faces"


def test_layers_import_only_downwards():
    """Read from the folders: planning and the writers reach no face, no lab and nothing of the
    engine that reaches the native seam (the engine's declarations, pins and header, load no
    library); the engine reaches no face, lab or writer; the lab no face but the drop-in."""
    mods = _modules()
    assert all((PACKAGE / layer / "__init__.py").is_file() for layer in LAYERS)
    graph = {name: _imports(name, path, mods, top_level_only=False) for name, path in mods.items()}
    seam = {m for m in mods if _layer(m) == "engine" and (m == NATIVE or NATIVE in _reach(graph, m))}
    assert {NATIVE, "empanel_gguf.engine.pools", "empanel_gguf.engine.rpc"} <= seam  # the rule can fail
    forbidden = {
        "planning": lambda m: _layer(m) in ("faces", "lab", "models") or m in seam,
        "models": lambda m: _layer(m) in ("faces", "lab") or m in seam,
        "engine": lambda m: _layer(m) in ("faces", "lab", "models"),
        "lab": lambda m: _layer(m) == "faces" and m != DROP_IN,
    }
    for module in sorted(mods):
        layer = _layer(module)
        if layer == "faces":
            continue
        bad = sorted(m for m in _reach(graph, module) if forbidden[layer](m))
        assert not bad, f"{module} ({layer}/) imports {bad} (directly or through others)"


def test_no_module_level_import_circles():
    mods = _modules()
    graph = {name: _imports(name, path, mods, top_level_only=True) for name, path in mods.items()}
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reach(graph, b)})
    assert not circles, f"modules that import each other: {circles}"


def _sidecar_call_graph():
    """Each csrc/*.c unit -> the units whose functions it calls."""
    units = {path.stem: path.read_text() for path in (REPO / "csrc").glob("*.c")}
    defined = {}
    for unit, text in units.items():
        for fn in re.findall(r"^[a-z_][\w \*]*?\b(empanel_\w+)\s*\(", text, re.M):
            defined.setdefault(fn, unit)
    return units, {unit: {defined[fn] for fn in re.findall(r"\b(empanel_\w+)\s*\(", text)
                          if fn in defined and defined[fn] != unit} for unit, text in units.items()}


def test_sidecar_units_have_no_circles():
    """Each csrc/*.c unit's calls into functions defined in other units form no circle: the units
    stand in layers (util.c at the bottom; slots.c the tables under remap.c, guess.c and preload.c;
    pool.c and load.c on top)."""
    _, graph = _sidecar_call_graph()
    assert graph["util"] == set()
    for unit in ("pool", "reader", "files", "rpc"):
        assert "util" in graph[unit], unit
    # the slot tables do no I/O and know nothing above them
    assert graph["slots"] <= {"backend", "util"}, graph["slots"]
    assert not ({"remap", "guess"} & (graph["remap"] | graph["guess"])), "remap.c and guess.c call each other"
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reach(graph, b)})
    assert not circles, f"csrc units that call each other (directly or through others): {circles}"


def test_only_load_calls_libllama():
    """The hook API is the only boundary: of the sidecar's units only csrc/load.c includes
    llama-empanel.h and calls libllama; the others read the shared header of constants and
    callback types. No name is ours in both libraries: libllama's start with llama_empanel_."""
    hooks = (REPO / "patches" / "files" / "include" / "llama-empanel.h").read_text()
    exported = set(re.findall(r"LLAMA_API[^;(]*?\b(llama_\w+)\s*\(", hooks))
    assert {"llama_empanel_set_plan", "llama_empanel_pool_info", "llama_empanel_model_file"} <= exported
    units, _ = _sidecar_call_graph()
    callers = sorted(unit for unit, text in units.items()
                     if re.search(r"\bllama_\w+\s*\(", re.sub(r'"[^"\n]*"', "", text)) and unit != "backend"
                     or '#include "llama-empanel.h"' in text)
    assert callers == ["load"], callers
    # backend.c names libllama's structs only to report their sizes (sizeof), and calls ggml
    assert not (set(re.findall(r"\b(llama_\w+)\s*\(", units["backend"])) - {"llama_empanel_buffer_in_host_memory",
                                                                              "llama_empanel_device_is_gpu",
                                                                              "llama_empanel_device_is_rpc"})
    ours_in_llama = "".join(path.read_text() for path in (REPO / "patches" / "files" / "src").glob("*.cpp"))
    defined = set(re.findall(r"^(?:static )?[\w:<>\* ]*?\b(\w*empanel_\w+)\s*\([^;]*?\)\s*\{", ours_in_llama, re.M))
    assert defined and all(name.startswith("llama_empanel_") for name in defined), sorted(
        name for name in defined if not name.startswith("llama_empanel_"))
    sidecar_defined = {fn for text in units.values() for fn in re.findall(r"^[a-z_][\w \*]*?\b(\w+)\s*\(", text, re.M)}
    assert not any(name.startswith("llama_") for name in sidecar_defined)


def test_counters_are_declared_once():
    """The counters of EMPANEL_LAYER_COUNTERS are the C struct (as cffi sees it), the names Python
    reports, and the metric names; nothing else lists them."""
    from empanel_gguf.engine import native
    from empanel_gguf.engine.header import COUNTERS
    from empanel_gguf.engine.stats import NAMES, layer_stats

    ffi = native.native().ffi
    fields = [name for name, _ in ffi.typeof("struct empanel_layer_stats").fields]
    assert fields == [c.field for c in COUNTERS]
    assert all(ffi.typeof("struct empanel_layer_stats").fields[i][1].type.cname == "uint64_t"
               for i in range(len(fields)))
    row = layer_stats({0: {c.field: 1_000_000_000 for c in COUNTERS}})["layers"][0]
    assert set(NAMES) <= set(row) and row["read_s"] == 1.0 and row["hits"] == 1_000_000_000
    metrics = [c.metric for c in COUNTERS if c.metric]
    assert len(metrics) == len(set(metrics)) and {"expert_hits_total", "slots_resident"} <= set(metrics)
    # no other file spells the counters out: a list of three or more field names in a row
    name = "(?:" + "|".join(re.escape(c.field) for c in COUNTERS) + ")"
    listing = re.compile(rf'["\']{name}["\'],\s*["\']{name}["\'],\s*["\']{name}["\']')
    assert listing.search(repr(tuple(c.field for c in COUNTERS[:3])))  # it finds what it looks for
    for path in list(PACKAGE.rglob("*.py")) + list((REPO / "csrc").glob("*.c")):
        assert not listing.search(path.read_text()), f"{path} lists the counters again"


def test_pins_equal_the_hook_header():
    """engine/pins.py's copies of the hook header's numbers (the API version, the O_DIRECT block that
    plain pools are placed by) are the header's."""
    from empanel_gguf.engine import pins

    header = (REPO / "patches" / "files" / "include" / "llama-empanel-shared.h").read_text()
    defines = dict(re.findall(r"#define (LLAMA_EMPANEL_\w+) (\d+)", header))
    assert int(defines["LLAMA_EMPANEL_API_VERSION"]) == pins.EMPANEL_API_VERSION
    assert int(defines["LLAMA_EMPANEL_READ_ALIGN"]) == pins.READ_ALIGN


def test_policies_are_declared_once():
    from empanel_gguf.engine import native
    from empanel_gguf.engine.header import ENGINE_POLICIES, policy_id

    names = []
    while (name := native.native().sidecar.empanel_policy_name(len(names))) != native.native().ffi.NULL:
        names.append(native.native().ffi.string(name).decode())
    assert tuple(names) == ENGINE_POLICIES == ("lru", "lfu-decay", "g-lru")
    assert [policy_id(n) for n in names] == [0, 1, 2]
    with pytest.raises(ValueError, match="one of lru, lfu-decay, g-lru"):
        policy_id("fifo")


def test_unknown_moe_option_is_refused(tmp_path):
    """llama_cpp.Llama swallows unknown keywords: a misspelt moe_* option would load stock."""
    from empanel_gguf import Llama

    with pytest.raises(ValueError, match=r"unknown MoE option moe_slot: the options are moe_slots, moe_policy"):
        Llama(str(tmp_path / "never-read.gguf"), moe_slot="25%")


def test_moe_profile_off_means_none():
    from empanel_gguf.planning.plan import moe_options

    for text in ("none", "off", "OFF", ""):
        assert moe_options(moe_profile=text).profile is None
    assert moe_options(moe_profile="auto").profile == "auto"


def test_sidecar_of_another_build_is_refused(tmp_path):
    """A libempanel whose version differs from the empanel.h beside it is refused at once."""
    from empanel_gguf.engine import native
    from empanel_gguf.engine.header import SIDECAR_VERSION

    lib = native.lib_dir()
    for path in lib.iterdir():
        if path.name != "empanel.h":
            (tmp_path / path.name).symlink_to(path)
    header = (lib / "empanel.h").read_text()
    (tmp_path / "empanel.h").write_text(header.replace(f"#define EMPANEL_SIDECAR_VERSION {SIDECAR_VERSION}",
                                                       f"#define EMPANEL_SIDECAR_VERSION {SIDECAR_VERSION + 1}"))
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env["EMPANEL_GGUF_LIB_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "from empanel_gguf.engine import native; native.native()"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "NativeLibraryError" in proc.stderr and "different builds" in proc.stderr, proc.stderr[-2000:]


def test_faces_plan_once(tmp_path, monkeypatch):
    """A face plans with plan_load and hands the plan to Llama(moe_load=...): Llama plans nothing
    again, and its pools are the plan's."""
    from empanel_gguf import Llama
    from empanel_gguf.models import fixtures
    from empanel_gguf.planning import plan
    from empanel_gguf.planning.index import load_index

    path = fixtures.write_fixture("qwen3moe-q8_0", tmp_path)
    index = load_index(path)
    load = plan.plan_load(index, "25%", {"n_ctx": 64}, options=plan.moe_options(moe_profile=None))
    calls = []
    real = plan.plan_load
    monkeypatch.setattr(plan, "plan_load", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr("empanel_gguf.llama.plan_load", plan.plan_load)
    llm = Llama(str(path), moe_load=load, n_ctx=64, verbose=False)
    try:
        assert calls == []
        assert llm.moe_slots == "25%"
        slots = {il: row["n_slots"] for il, row in llm.moe_stats()["layers"].items()}
        assert slots == {il: n for il, n in enumerate(load.plan.n_slots) if n > 0}
    finally:
        llm.close()
    with pytest.raises(ValueError, match="was planned for"):
        Llama(str(fixtures.write_fixture("mixtral", tmp_path)), moe_load=load, n_ctx=64, verbose=False)
