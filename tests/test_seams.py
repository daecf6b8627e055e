"""The seams hold: the layers import only downwards (planning loads no library), no module imports
another that imports it back, the sidecar's units share their helpers without circles, counters and
policies are declared once (csrc/empanel.h), the MoE options once (planning/options.py), and every
face plans once."""

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
# a face. abi/ (the header's declarations and the pins, read as data) is the floor; planning/ (pure
# Python over the model's header and our cache files) stands on it, below engine/ (the native seam
# and what runs on it), which stands below the faces; lab/ stands beside the engine, models/ (the
# writers) on planning's GGUF reader. BELOW: the layers each may import besides itself.
LAYERS = ("abi", "planning", "engine", "lab", "models")
BELOW = {"abi": set(), "planning": {"abi"}, "models": {"abi", "planning"}, "engine": {"abi", "planning"},
         "lab": {"abi", "planning", "engine", "models"}}
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


def _layer_violations(graph):
    """(module, what it reaches that its layer may not) for every module of a layer: a layer reaches
    only itself and the layers BELOW it (lab: the drop-in face too); planning and the writers
    reach no library."""
    found = []
    for module in sorted(graph):
        layer = _layer(module)
        if layer == "faces":
            continue
        reach = _reach(graph, module) - (_reach(graph, DROP_IN) | {DROP_IN} if layer == "lab" else set())
        bad = sorted(m for m in reach if _layer(m) not in BELOW[layer] | {layer})
        if bad:
            found.append((module, bad))
    return found


def _package_cycles(graph):
    """Pairs of layer packages that import each other, directly or through other layer packages."""
    packages = {layer: set() for layer in LAYERS}
    for module, targets in graph.items():
        if _layer(module) != "faces":
            packages[_layer(module)] |= {_layer(m) for m in targets if _layer(m) not in ("faces", _layer(module))}
    return sorted({tuple(sorted((a, b))) for a in packages for b in packages[a] if a in _reach(packages, b)})


def test_layers_import_only_downwards():
    """Read from the folders: no layer package imports another that imports it back (planning
    imports no engine module: the engine stands on planning, both on abi), and each layer reaches
    only the layers below it: planning and the writers no face, lab, engine or library; the engine
    no face, lab or writer; the lab no face but the drop-in."""
    mods = _modules()
    assert all((PACKAGE / layer / "__init__.py").is_file() for layer in LAYERS)
    graph = {name: _imports(name, path, mods, top_level_only=False) for name, path in mods.items()}
    assert not _package_cycles(graph), f"layer packages that import each other: {_package_cycles(graph)}"
    assert not _layer_violations(graph), "\n".join(f"{m} ({_layer(m)}/) imports {bad} (directly or through "
                                                    "others)" for m, bad in _layer_violations(graph))
    seam = {m for m in mods if m == NATIVE or NATIVE in _reach(graph, m)}
    assert not any(_layer(m) in ("abi", "planning", "models") for m in seam), sorted(seam)
    # the checks can fail: planning importing the engine back is a cycle and a violation
    planted = dict(graph, **{"empanel_gguf.planning.plan": graph["empanel_gguf.planning.plan"]
                             | {"empanel_gguf.engine.pools"}})
    assert _package_cycles(planted) == [("engine", "planning")]
    assert any(m == "empanel_gguf.planning.plan" and "empanel_gguf.engine.native" in bad
               for m, bad in _layer_violations(planted))


def test_no_module_level_import_circles():
    mods = _modules()
    graph = {name: _imports(name, path, mods, top_level_only=True) for name, path in mods.items()}
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reach(graph, b)})
    assert not circles, f"modules that import each other: {circles}"


def _sidecar_call_graph(folder=REPO / "csrc", pattern="*.c", prefix="empanel_"):
    """Each unit (csrc/*.c by default) -> the units whose functions (named prefix...) it calls."""
    units = {path.stem: path.read_text() for path in folder.glob(pattern)}
    defined = {}
    for unit, text in units.items():
        for fn in re.findall(rf"^[a-z_][\w \*:<>]*?\b({prefix}\w+)\s*\(", text, re.M):
            defined.setdefault(fn, unit)
    return units, {unit: {defined[fn] for fn in re.findall(rf"\b({prefix}\w+)\s*\(", text)
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


def test_llama_side_units_have_no_circles():
    """Our sources in libllama (patches/files/src/*.cpp) call each other in layers too: the graph's
    ops look their layers up in the registry, and the registry calls nothing of the graph."""
    _, graph = _sidecar_call_graph(REPO / "patches" / "files" / "src", "*.cpp", "llama_empanel_")
    assert "llama-empanel-registry" in graph["llama-empanel-graph"], graph  # the check sees calls
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reach(graph, b)})
    assert not circles, f"libllama-side units that call each other (directly or through others): {circles}"


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


def _csrc_texts():
    """{file name: text} of csrc's C sources and headers."""
    return {path.name: path.read_text() for path in sorted((REPO / "csrc").glob("*.[ch]"))}


def _include_graph(texts):
    """(units, shared, graph): the units (a .c and its .h), the shared headers (a .h without a .c,
    and the public empanel.h) and, for each, the units and shared headers its files include."""
    units = {name[:-2] for name in texts if name.endswith(".c")}
    shared = {name[:-2] for name in texts if name.endswith(".h")} - units
    graph = {node: set() for node in units | shared}
    for name, text in texts.items():
        node = name[:-2]
        for header in re.findall(r'^#include "(\w+)\.h"', text, re.M):
            if header in graph and header != node:
                graph[node].add(header)
    return units, shared, graph


def _declared(text):
    """The names a header declares: functions, structs, enums and their values, macros."""
    return set(re.findall(r"\b(empanel_\w+)\s*\(", text)) | set(re.findall(r"(?:struct|enum) (empanel_\w+) \{", text)) \
        | set(re.findall(r"^\s+(EMPANEL_\w+)\s*[,=]", text, re.M)) | set(re.findall(r"^#define (EMPANEL_\w+)", text, re.M))


def _include_problems(texts):
    """What is wrong with how csrc's units include each other: a unit without its own header (or
    not including it first), a circle of includes between units, a shared header or util.c that
    includes a unit, a unit header included but not used, a unit calling a function of a unit it
    does not include, an EMPANEL_API function defined where empanel.h is not included, an internal
    header over 300 lines."""
    units, shared, graph = _include_graph(texts)
    problems = []
    for unit in sorted(units):
        first = re.search(r'^#include "(\w+)\.h"', texts[f"{unit}.c"], re.M)
        if f"{unit}.h" not in texts or first is None or first.group(1) != unit:
            problems.append(f"{unit}.c: its own header {unit}.h is not its first include")
    for node in sorted(graph):
        if node in _reach(graph, node):
            problems.append(f"{node}: includes a header that includes it back (through {sorted(graph[node])})")
    for node in sorted(shared | {"util"}):
        if graph[node] - shared:
            problems.append(f"{node}: at the bottom, yet includes the units {sorted(graph[node] - shared)}")
    defined = {fn: unit for unit in units
               for fn in re.findall(r"^[a-z_][\w \*]*?\b(empanel_\w+)\s*\(", texts[f"{unit}.c"], re.M)}
    api = set(re.findall(r"EMPANEL_API[^;(]*?\b(empanel_\w+)\s*\(", texts["empanel.h"]))
    for unit in sorted(units):
        text = re.sub(r'#include "\w+\.h"', "", texts[f"{unit}.c"])
        for header in sorted(graph[unit] & units):
            used = _declared(texts.get(f"{header}.h", "")) | {fn for fn, u in defined.items() if u == header}
            if not re.search(r"\b(" + "|".join(used) + r")\b", text):
                problems.append(f"{unit}.c includes {header}.h and uses nothing it declares")
        called = {defined[fn] for fn in re.findall(r"\b(empanel_\w+)\s*\(", text) if defined.get(fn, unit) != unit}
        if called - _reach(graph, unit):
            problems.append(f"{unit}.c calls functions of {sorted(called - _reach(graph, unit))} without their headers")
        if (api & {fn for fn, u in defined.items() if u == unit}) and "empanel" not in _reach(graph, unit):
            problems.append(f"{unit}.c defines EMPANEL_API functions without empanel.h (they would not be exported)")
    for name, text in texts.items():
        if name.endswith(".h") and name != "empanel.h" and text.count("\n") > 300:
            problems.append(f"{name}: {text.count(chr(10))} lines (an internal header holds one unit's, at most 300)")
    return problems


def test_sidecar_includes_stand_in_layers():
    """Each csrc unit has its own header and includes only the headers of units below it: no
    circle of includes, the shared headers (common.h, layer.h, io.h, state.h) and util.c at the
    bottom, no header included for nothing, none over 300 lines. The check fails where it should."""
    texts = _csrc_texts()
    assert _include_problems(texts) == []
    units, shared, graph = _include_graph(texts)
    assert {"common", "layer", "io", "state", "empanel"} <= shared and {"slots", "pool", "load"} <= units
    assert "slots" in _reach(graph, "pool") and "pool" in _reach(graph, "load")  # pool.c on the tables, load.c on pools

    def planted(name, line, at='#include "state.h"\n'):
        bad = dict(texts)
        bad[name] = bad[name].replace(at, at + line, 1)
        assert bad[name] != texts[name], name
        return _include_problems(bad)

    assert any(p.startswith("slots: includes a header that includes it back") for p in
               planted("slots.c", '#include "pool.h"\n'))  # pool.c includes slots.h: a circle
    assert any("at the bottom" in p for p in planted("util.c", '#include "slots.h"\n'))
    assert any("uses nothing it declares" in p for p in planted("trace.c", '#include "ring.h"\n'))
    assert any(p.startswith("slots.h: ") and "at most 300" in p for p in
               _include_problems({**texts, "slots.h": texts["slots.h"] + "//\n" * 300}))
    no_header = {name: text for name, text in texts.items() if name != "ring.h"}
    assert any("ring.c: its own header" in p for p in _include_problems(no_header))


def test_counters_are_declared_once():
    """The counters of EMPANEL_LAYER_COUNTERS are the C struct (as cffi sees it), the names Python
    reports, and the metric names; nothing else lists them."""
    from empanel_gguf.engine import native
    from empanel_gguf.abi.header import COUNTERS
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


def test_prometheus_series_have_one_writer():
    """Every Prometheus family the sidecar writes (csrc/metrics.c: llama.cpp's programs and serve
    alike) is written there alone: no Python source names one as a family it writes itself
    (serve once wrote empanel_slot_pools and empanel_hit_rate beside the sidecar)."""
    from empanel_gguf.abi.header import COUNTERS

    c_text = (REPO / "csrc" / "metrics.c").read_text()
    families = {c.metric for c in COUNTERS if c.metric} | set(re.findall(r"# TYPE empanel_(\w+) ", c_text)) | set(re.findall(r'X\(\w+,\s*\w+,\s*"(\w+)"', c_text))
    assert {"slot_pools", "hit_rate", "rpc_reloads_total", "budget_bytes"} <= families, families
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for family in families:
            assert not re.search(rf"[\"']empanel_{family}[\"'{{ ]", text), f"{path} writes empanel_{family} itself"


def test_the_hook_headers_numbers_are_read_not_copied():
    """The hook header's numbers (the API version libllama must report, the O_DIRECT block plain
    pools are placed by) are read from llama-empanel-shared.h as installed beside the libraries, not
    repeated in Python: abi/pins.py holds only what pins llama.cpp's source."""
    from empanel_gguf.abi import header, pins

    text = header.header_path(header.SOURCE_SHARED_HEADER).read_text()
    assert header.API_VERSION == int(re.search(r"#define LLAMA_EMPANEL_API_VERSION (\d+)", text).group(1))
    assert header.READ_ALIGN == int(re.search(r"#define LLAMA_EMPANEL_READ_ALIGN (\d+)", text).group(1))
    assert [n for n in vars(pins) if n.isupper()] == ["LLAMA_CPP_PYTHON_VERSION", "LLAMA_CPP_PYTHON_SDIST",
                                                      "LLAMA_CPP_PYTHON_SHA256", "LLAMA_COMMIT"]
    for path in PACKAGE.rglob("*.py"):
        if path.name != "header.py":
            assert not re.search(r"^(API_VERSION|READ_ALIGN|EMPANEL_API_VERSION) *=", path.read_text(), re.M), path


def test_policies_are_declared_once():
    from empanel_gguf.engine import native
    from empanel_gguf.abi.header import ENGINE_POLICIES, policy_id

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

    with pytest.raises(ValueError, match=r"unknown MoE option moe_slot; did you mean moe_slots\? "
                                         r"\(the options: moe_slots, moe_policy"):
        Llama(str(tmp_path / "never-read.gguf"), moe_slot="25%")
    with pytest.raises(ValueError, match=r"unknown MoE option moe_zzz \(the options: "):
        Llama(str(tmp_path / "never-read.gguf"), moe_zzz=1)


def test_moe_profile_off_means_none():
    from empanel_gguf.planning.plan import moe_options

    for text in ("none", "off", "OFF", ""):
        assert moe_options(moe_profile=text).profile is None
    assert moe_options(moe_profile="auto").profile == "auto"


def test_sidecar_of_another_build_is_refused(tmp_path):
    """A libempanel whose version differs from the empanel.h beside it is refused at once."""
    from empanel_gguf.engine import native
    from empanel_gguf.abi.header import SIDECAR_VERSION

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


def _option_declarations(text, options):
    """Where the Python source `text` spells MoE options out again: a flag ("--moe-policy") or
    environment variable ("LLAMA_ARG_MOE_POLICY") of the table as a string of its own, or three or
    more options in one place: a literal list of their names, a function taking them as keywords
    (a signature with defaults), a call passing each through (moe_policy=args.moe_policy, ...), a
    class declaring them as fields (policy: str = "auto")."""
    keywords = {o.keyword for o in options}
    names = keywords | {o.name for o in options}
    strings = {f for o in options for f in o.flags if f.startswith("--")} | {o.env for o in options if o.env}
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and node.value in strings:
            found.append(node.value)
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in keywords]
            found += [listed] if len(listed) >= 3 else []
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            taken = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg in keywords]
            found += [taken] if len(taken) >= 3 else []
        elif isinstance(node, ast.Call):
            passed = [k.arg for k in node.keywords if k.arg in keywords and
                      getattr(k.value, "id", getattr(k.value, "attr", None)) in (k.arg, k.arg[len("moe_"):])]
            found += [passed] if len(passed) >= 3 else []
        elif isinstance(node, ast.ClassDef):
            declared = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and s.target.id in names]
            found += [declared] if len(declared) >= 3 else []
    return found


def test_moe_options_are_declared_once():
    """Every MoE option's name, default, check, flag, environment variable and help live in one
    table (planning/options.py); MoeOptions, Llama's keywords and docstring, the commands'
    arguments and docs/options.md are made from it, and no other module spells the options out."""
    from empanel_gguf import Llama
    from empanel_gguf.commands.options import add_moe_args
    from empanel_gguf.planning import options
    from empanel_gguf.planning.plan import MoeOptions

    import argparse
    import dataclasses
    import inspect

    table = {o.keyword: o.default for o in options.OPTIONS}
    assert {f"moe_{f.name}": f.default for f in dataclasses.fields(MoeOptions)} == {
        k: v for k, v in table.items() if k != "moe_slots"}
    signature = inspect.signature(Llama)
    assert {k: p.default for k, p in signature.parameters.items() if k.startswith("moe_") and k != "moe_load"} == table
    assert all(o.keyword in Llama.__doc__ for o in options.OPTIONS)
    parser = argparse.ArgumentParser()
    add_moe_args(parser)
    by_dest = {a.dest: a for a in parser._actions}
    for o in options.OPTIONS:
        if o.flags:
            assert by_dest[o.keyword].option_strings == list(o.flags) and o.env in by_dest[o.keyword].help
    assert (REPO / "docs" / "options.md").read_text() == options.markdown(), \
        "docs/options.md is stale: python3 scripts/options_doc.py"
    # the check finds what it looks for: the four old spellings, planted
    planted = ['env_arg(parser, "--moe-io-threads", type=int, default=8)',
               'os.environ.get("LLAMA_ARG_MOE_QUEUE_DEPTH")',
               'def __init__(self, path, moe_slots=None, moe_policy="auto", moe_io_threads=8): pass',
               'KEYS = ("moe_policy", "moe_chunk_kb", "moe_guess")',
               'moe_options(moe_policy=args.moe_policy, moe_guess=args.moe_guess, moe_verify=moe_verify)',
               'class MoeOptions:\n    policy: str = "auto"\n    io_threads: int = 8\n    chunk_kb: int = 256\n']
    assert [bool(_option_declarations(text, options.OPTIONS)) for text in planted] == [True] * 6
    assert not _option_declarations('Llama(path, moe_slots="25%", moe_trace=True, moe_profile=None)', options.OPTIONS)
    for path in PACKAGE.rglob("*.py"):
        if path != PACKAGE / "planning" / "options.py":
            found = _option_declarations(path.read_text(), options.OPTIONS)
            assert not found, f"{path.relative_to(REPO)} declares MoE options again: {found}"


@pytest.mark.parametrize("bad, message", [
    (dict(moe_io_threads=300), "moe_io_threads=300: reader threads besides the decoding thread, 0 to 256"),
    (dict(moe_io_threads=-1), "moe_io_threads=-1: .*0 to 256"),
    (dict(moe_chunk_kb=2), "moe_chunk_kb=2: KiB per read request, 4 to 1048576"),
    (dict(moe_chunk_kb=1048577), "moe_chunk_kb=1048577: .*4 to 1048576"),
    (dict(moe_queue_depth=0), "moe_queue_depth=0: read requests in flight, 1 to 256"),
    (dict(moe_queue_depth=300), "moe_queue_depth=300: .*1 to 256"),
    (dict(moe_read_io="fast"), "moe_read_io='fast': 'auto', 'threads'"),
    (dict(moe_policy="fifo"), "moe_policy='fifo': auto or one of lru, lfu-decay, g-lru"),
    (dict(moe_prefetch=-1), "moe_prefetch=-1: 'auto' or a number"),
    (dict(moe_subst=1.5), r"moe_subst=1.5: a ratio in \(0, 1\]"),
    (dict(moe_repack="plain"), "moe_repack='plain': 'auto', True"),
])
def test_options_out_of_range_are_named_before_any_c_runs(tmp_path, bad, message):
    """A value out of range is a ValueError naming the option (the bounds are csrc/empanel.h's),
    raised in Python before the model is read or a pool made."""
    from empanel_gguf import Llama
    from empanel_gguf.planning.options import moe_options

    with pytest.raises(ValueError, match=f"^{message}"):
        moe_options(**bad)
    with pytest.raises(ValueError, match=f"^{message}"):
        Llama(str(tmp_path / "never-read.gguf"), moe_slots="25%", **bad)
