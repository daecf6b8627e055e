"""The build's source step (scripts/llama_source.py) and the native seam (empanel_gguf/engine/native.py).

The patch step is exercised on throwaway trees, the real patches on the pinned llama.cpp.
"""

import ctypes
import importlib.util
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("llama_source", REPO / "scripts" / "llama_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llama_source = load_script()


def write_tree(root, files):
    for rel, text in files.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def make_patch(tmp_path, name, before, after):
    """A unified diff from two {path: text} trees, as `git diff --no-index` writes it."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        if d.exists():
            subprocess.run(["rm", "-rf", str(d)], check=True)
    write_tree(a, before)
    write_tree(b, after)
    proc = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a", "b"], cwd=tmp_path,
                          capture_output=True, text=True)
    # --no-prefix gives "a/x" and "b/x" as the paths: the tree roots stand in for the prefixes
    patch = tmp_path / name
    patch.write_text(proc.stdout)
    return patch


ORIGINAL = {
    "src/graph.cpp": "int top_k(void) {\n    return 8;\n}\n\nint layers(void) {\n    return 48;\n}\n",
    "include/api.h": "#pragma once\nint top_k(void);\n",
}


def patched(**changes):
    files = dict(ORIGINAL)
    files.update(changes)
    return files


def test_patch_applies_once_then_is_skipped(tmp_path):
    first = make_patch(tmp_path, "0001-topk.patch", ORIGINAL,
                       patched(**{"src/graph.cpp": ORIGINAL["src/graph.cpp"].replace("8", "4")}))
    tree = tmp_path / "tree"
    write_tree(tree, ORIGINAL)

    logs = []
    assert llama_source.apply_patches(tree, [first], log=logs.append) == ["0001-topk.patch"]
    assert "return 4;" in (tree / "src/graph.cpp").read_text()

    # again: already applied, skipped, tree unchanged
    assert llama_source.apply_patches(tree, [first], log=logs.append) == []
    assert "already applied" in logs[-1]
    assert (tree / "src/graph.cpp").read_text().count("return 4;") == 1


def test_patch_that_does_not_apply_fails_naming_patch_and_hunk(tmp_path):
    bad = make_patch(tmp_path, "0002-layers.patch", ORIGINAL,
                     patched(**{"src/graph.cpp": ORIGINAL["src/graph.cpp"].replace("48", "64")}))
    tree = tmp_path / "tree"
    drifted = dict(ORIGINAL)
    drifted["src/graph.cpp"] = ORIGINAL["src/graph.cpp"].replace("return 48;", "return 94;")
    write_tree(tree, drifted)
    before = (tree / "src/graph.cpp").read_text()

    with pytest.raises(llama_source.SourceError) as err:
        llama_source.apply_patches(tree, [bad], log=lambda _: None)
    message = str(err.value)
    assert "0002-layers.patch" in message
    assert "src/graph.cpp" in message  # git names the file and line of the failing hunk
    assert (tree / "src/graph.cpp").read_text() == before  # nothing half-applied


def test_patch_inside_another_repository_stays_in_its_tree(tmp_path):
    """A tree nested in a git repository (the build dir in a checkout) is patched as a plain
    directory: paths are relative to the tree, not to the repository."""
    subprocess.run(["git", "init", "-q", str(tmp_path / "outer")], check=True)
    tree = tmp_path / "outer" / "build" / "llama.cpp"
    write_tree(tree, ORIGINAL)
    patch = make_patch(tmp_path, "0001-api.patch", ORIGINAL,
                       patched(**{"include/api.h": ORIGINAL["include/api.h"] + "int n_slots(void);\n"}))
    assert llama_source.apply_patches(tree, [patch], log=lambda _: None) == ["0001-api.patch"]
    assert "n_slots" in (tree / "include/api.h").read_text()


def test_sync_tree_rewrites_only_changed_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_tree(src, ORIGINAL)
    write_tree(dst, ORIGINAL)
    (dst / "stale.txt").write_text("gone after sync")
    os.utime(dst / "include/api.h", (1_000_000, 1_000_000))
    (src / "src/graph.cpp").write_text("changed\n")

    llama_source.sync_tree(src, dst)
    assert (dst / "src/graph.cpp").read_text() == "changed\n"
    assert os.stat(dst / "include/api.h").st_mtime == 1_000_000  # untouched: no rebuild
    assert not (dst / "stale.txt").exists()


def test_extract_skips_models_and_git_pointer(tmp_path):
    root = tmp_path / "llama_cpp_python-0.3.36"
    write_tree(root, {
        "vendor/llama.cpp/src/llama.cpp": "// llama\n",
        "vendor/llama.cpp/models/ggml-vocab.gguf": "big",
        "vendor/llama.cpp/.git": "gitdir: ../../.git/modules/vendor/llama.cpp\n",
        "llama_cpp/llama.py": "# python\n",
    })
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    out = tmp_path / "out"
    assert llama_source.extract_llama(sdist, out) == 1
    assert (out / "src/llama.cpp").exists()
    assert not (out / "models").exists() and not (out / ".git").exists()


def test_wrong_sdist_hash_is_refused(tmp_path):
    fake = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    fake.write_bytes(b"not the pinned sdist")
    with pytest.raises(llama_source.SourceError, match="SHA-256"):
        llama_source.check_sdist(fake, llama_source.load_pins())


def test_real_patches_apply_to_pinned_llama_cpp(tmp_path):
    """patches/*.patch against the llama.cpp of the pinned sdist (cached by the build)."""
    pins = llama_source.load_pins()
    sdist = llama_source.cache_dir() / pins.LLAMA_CPP_PYTHON_SDIST
    if os.environ.get("EMPANEL_LLAMA_SDIST"):
        sdist = Path(os.environ["EMPANEL_LLAMA_SDIST"])
    if not sdist.exists():
        pytest.skip(f"{sdist} not cached (the build fetches it)")
    llama_source.check_sdist(sdist, pins)
    tree = tmp_path / "llama.cpp"
    llama_source.extract_llama(sdist, tree)
    files = llama_source.our_files(REPO / "patches")
    assert "src/llama-empanel.cpp" in files and "include/llama-empanel.h" in files
    assert llama_source.add_files(tree, files, log=lambda _: None) == list(files)  # none of llama.cpp's replaced
    patches = sorted((REPO / "patches").glob("*.patch"))
    assert patches, "patches/ is empty"
    applied = llama_source.apply_patches(tree, patches, log=lambda _: None)
    assert applied == [p.name for p in patches]
    assert (tree / "include" / "llama-empanel.h").exists()
    # idempotent on the real tree as well
    assert llama_source.apply_patches(tree, patches, log=lambda _: None) == []
    assert llama_source.add_files(tree, files, log=lambda _: None) == []


def test_our_files_never_replace_llama_cpp_files(tmp_path):
    """patches/files/ adds new files only: one that would overwrite a file of llama.cpp's tree
    (or a different version of ours) is refused, naming it; an identical copy is skipped."""
    tree = tmp_path / "tree"
    write_tree(tree, ORIGINAL)
    ours = tmp_path / "patches" / llama_source.FILES_DIR
    write_tree(ours, {"src/ours.cpp": "int ours(void) { return 1; }\n"})
    files = llama_source.our_files(tmp_path / "patches")
    assert llama_source.add_files(tree, files, log=lambda _: None) == ["src/ours.cpp"]
    assert llama_source.add_files(tree, files, log=lambda _: None) == []  # already there
    write_tree(ours, {"src/graph.cpp": "int replaced;\n"})
    with pytest.raises(llama_source.SourceError, match="would replace llama.cpp's own src/graph.cpp"):
        llama_source.add_files(tree, llama_source.our_files(tmp_path / "patches"), log=lambda _: None)
    assert (tree / "src" / "graph.cpp").read_text() == ORIGINAL["src/graph.cpp"]


def test_prepared_tree_changes_with_our_files(tmp_path):
    """The prepared tree's stamp covers patches/files/: editing one of our sources prepares the
    tree again (else the build would compile a stale copy)."""
    pins = llama_source.load_pins()
    write_tree(tmp_path / llama_source.FILES_DIR, {"src/ours.cpp": "// one\n"})
    files = llama_source.our_files(tmp_path)
    before = llama_source.prepare_stamp(pins, files, [])
    assert llama_source.prepare_stamp(pins, files, []) == before
    write_tree(tmp_path / llama_source.FILES_DIR, {"src/ours.cpp": "// two\n"})
    assert llama_source.prepare_stamp(pins, files, []) != before


# -- the native seam ------------------------------------------------------------------------------


def run_python(code, **env):
    full_env = dict(os.environ)
    full_env.pop("LLAMA_CPP_LIB_PATH", None)
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_import_loads_our_library_and_checks_it():
    proc = run_python("""
        import empanel_gguf, llama_cpp
        from empanel_gguf.engine import native
        print(llama_cpp.llama_cpp._lib._name)
        print(native.native().sidecar.empanel_sidecar_version())
    """)
    assert proc.returncode == 0, proc.stderr
    loaded, version = proc.stdout.split()
    assert Path(loaded).parent == Path(_lib_dir())
    assert int(version) >= 1


def _lib_dir():
    from empanel_gguf.engine import native

    return native.lib_dir()


def test_struct_sizes_match_the_ctypes_mirrors():
    import empanel_gguf
    from empanel_gguf.engine import native

    size_fn = native.native().sidecar.empanel_struct_size  # sizeof() as our build compiled llama.h
    for name in native.MIRRORED_STRUCTS:
        assert size_fn(name.encode()) == ctypes.sizeof(getattr(empanel_gguf.llama_cpp.llama_cpp, name))
    assert size_fn(b"no_such_struct") == 0


def test_bindings_of_another_struct_layout_are_refused():
    """The import's check itself: ctypes bindings whose mirror of llama_context_params is one field
    longer than our build's struct (another llama-cpp-python) are refused, naming the struct."""
    import types

    import empanel_gguf
    from empanel_gguf.engine import native

    real = empanel_gguf.llama_cpp.llama_cpp
    native._check_struct_sizes(types.SimpleNamespace(llama_cpp=real))  # the real bindings pass

    class Longer(ctypes.Structure):
        _fields_ = list(real.llama_context_params._fields_) + [("one_more", ctypes.c_int64)]

    bindings = types.SimpleNamespace(**{name: getattr(real, name) for name in native.MIRRORED_STRUCTS})
    bindings.llama_context_params = Longer
    with pytest.raises(native.NativeLibraryError, match=r"ABI mismatch: sizeof\(llama_context_params\)"):
        native._check_struct_sizes(types.SimpleNamespace(llama_cpp=bindings))


def test_library_without_hooks_is_refused():
    """A real library that lacks our API (libggml-base) stands in for a foreign libllama."""
    from empanel_gguf.engine import native

    foreign = ctypes.CDLL(str(native.lib_dir() / native._shared_lib_name("ggml-base")))
    with pytest.raises(native.NativeLibraryError, match="without the empanel hooks"):
        native._check_llama(foreign, "libggml-base")


def test_llama_cpp_imported_first_with_our_library_is_accepted():
    proc = run_python("""
        import llama_cpp
        import empanel_gguf
        print("ok")
    """, LLAMA_CPP_LIB_PATH=str(_lib_dir()))
    assert proc.returncode == 0, proc.stderr


def test_missing_libraries_say_how_to_build(tmp_path):
    proc = run_python("import empanel_gguf", EMPANEL_GGUF_LIB_DIR=str(tmp_path))
    assert proc.returncode != 0
    assert "NativeLibraryError" in proc.stderr and "pip install ." in proc.stderr


def test_the_package_installs_only_its_own_files():
    """The installed package's RECORD: everything under empanel_gguf/ (its libraries, programs and
    header included) and the metadata, besides the console script; none of llama.cpp's own
    install rules (site-packages/lib, include, bin, cmake and pkg-config files)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("empanel-gguf")
    except metadata.PackageNotFoundError:
        pytest.skip("empanel-gguf is not installed (pip install .)")
    files = [str(f) for f in dist.files or []]
    if any(f.endswith(".pth") for f in files):
        pytest.skip("an editable install has no libraries in its RECORD")
    stray = [f for f in files if not f.startswith(("empanel_gguf/", "empanel_gguf-")) and "bin/empanel-gguf" not in f]
    assert not stray, f"installed outside the package: {stray[:10]} ({len(stray)} in all)"
    assert any(f.startswith("empanel_gguf/lib/") and "libllama" in f for f in files)


def test_readme_is_short_and_every_local_link_resolves():
    """The README stays a front door of one screen (what, install, one example, commands, the
    results, limits: at most 130 lines); what is behind it lives in docs/ (the options in
    docs/options.md), and no link points nowhere."""
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 130
    assert "(docs/options.md)" in readme
    pages = [REPO / "README.md", REPO / "patches" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}, which is missing"
