"""Get the llama.cpp source that empanel-gguf builds: fetch, verify, extract, add, patch.

The source is exactly the llama.cpp vendored by the pinned llama-cpp-python source distribution
(empanel_gguf/abi/pins.py). It is fetched with pip from the package registry at build time, checked
against its SHA-256 and extracted without the 75 MB of vocab models. Then our own files that must
sit in llama.cpp's tree (patches/files/: the llama_empanel_* hook module) are copied to the same
paths in it, and patches/*.patch (edits of llama.cpp's own files) are applied in order.
llama.cpp source is never committed to this repository.

    python scripts/llama_source.py prepare --dest build/llama.cpp --patches patches
    python scripts/llama_source.py apply --tree DIR patches/0001-*.patch   # on any tree

Environment:
    EMPANEL_LLAMA_SDIST   use this llama-cpp-python sdist file instead of fetching (hash-checked)
    EMPANEL_CACHE_DIR     where the fetched sdist is kept (default ~/.cache/empanel-gguf)

Patching is idempotent: a patch that is already applied is skipped; a patch that neither applies
nor is applied fails loudly, naming the patch and the hunk that failed. A file of ours that would
replace one of llama.cpp's own is refused.
"""

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# bump when this script changes what a prepared tree contains
PREPARE_FORMAT = 2

# under patches/: our own files, copied to the same relative paths in llama.cpp's tree
FILES_DIR = "files"

# parts of vendor/llama.cpp the build never reads (vocab GGUFs alone are 75 MB)
SKIPPED_DIRS = ("models", "media", "docs", ".devops", ".github")

# written into a prepared tree: a hash of the sdist and the patches it was made from
STAMP = ".empanel-prepared"


class SourceError(RuntimeError):
    """The llama.cpp source could not be fetched, verified, extracted or patched."""


def load_pins():
    """empanel_gguf/abi/pins.py, loaded by path so the build does not import the package."""
    spec = importlib.util.spec_from_file_location("_empanel_pins", REPO / "empanel_gguf" / "abi" / "pins.py")
    pins = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pins)
    return pins


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir():
    if os.environ.get("EMPANEL_CACHE_DIR"):
        return Path(os.environ["EMPANEL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "empanel-gguf"


def check_sdist(path, pins):
    digest = sha256_file(path)
    if digest != pins.LLAMA_CPP_PYTHON_SHA256:
        raise SourceError(
            f"{path}: SHA-256 {digest} is not the pinned {pins.LLAMA_CPP_PYTHON_SHA256} of "
            f"{pins.LLAMA_CPP_PYTHON_SDIST}. Delete the file and build again to refetch it."
        )


def pip_download(pins, dest):
    """Fetch the sdist with pip (from whatever index pip is configured for) into dest."""
    requirement = f"llama-cpp-python=={pins.LLAMA_CPP_PYTHON_VERSION}"
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--no-binary", "llama-cpp-python", "-d", str(dest)]
    # pip prepares the sdist's metadata; without isolation it skips installing its build
    # requirements (scikit-build-core is already here when we are the build backend)
    attempts = [base + ["--no-build-isolation", requirement], base + [requirement]]
    errors = []
    for cmd in attempts:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0 and (dest / pins.LLAMA_CPP_PYTHON_SDIST).exists():
            return dest / pins.LLAMA_CPP_PYTHON_SDIST
        errors.append(f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    raise SourceError(
        f"could not download {requirement} (source distribution) with pip:\n" + "\n".join(errors)
        + "\nHINT: download it elsewhere and set EMPANEL_LLAMA_SDIST=/path/to/"
        + pins.LLAMA_CPP_PYTHON_SDIST
    )


def fetch_sdist(pins):
    """Path of a verified copy of the pinned sdist: EMPANEL_LLAMA_SDIST, the cache, or pip."""
    given = os.environ.get("EMPANEL_LLAMA_SDIST")
    if given:
        check_sdist(given, pins)
        return Path(given)
    cached = cache_dir() / pins.LLAMA_CPP_PYTHON_SDIST
    if cached.exists():
        try:
            check_sdist(cached, pins)
            return cached
        except SourceError:
            cached.unlink()  # a broken download: fetch again
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        got = pip_download(pins, Path(tmp))
        check_sdist(got, pins)
        os.replace(got, cached)
    return cached


def extract_llama(sdist, dest):
    """Extract vendor/llama.cpp of the sdist into dest (which must not exist yet)."""
    prefix = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    dest = Path(dest)
    count = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.name.startswith(prefix):
                continue
            rel = member.name[len(prefix):]
            top = rel.split("/", 1)[0]
            if not rel or top in SKIPPED_DIRS or rel == ".git":
                continue  # .git is a submodule pointer file that leads nowhere here
            if not (member.isfile() or member.isdir()):
                continue
            target = dest / rel
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
            count += 1
    if count == 0:
        raise SourceError(f"{sdist}: no vendor/llama.cpp inside; is this a llama-cpp-python sdist?")
    return count


def git_apply(tree, patch, *flags):
    """Run `git apply` on a plain directory (never on a repository that contains it)."""
    tree = Path(tree).resolve()
    env = dict(os.environ)
    # stop git from finding an enclosing repository: paths must be relative to `tree`
    env["GIT_CEILING_DIRECTORIES"] = str(tree.parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    cmd = ["git", "apply", "--whitespace=nowarn", *flags, str(Path(patch).resolve())]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)


def apply_patches(tree, patches, log=print):
    """Apply patches in order; skip those already applied; raise SourceError on the first that
    does neither. Returns the names applied by this call."""
    if shutil.which("git") is None:
        raise SourceError("git is needed to apply patches/*.patch; install git and build again")
    applied = []
    for patch in patches:
        patch = Path(patch)
        if git_apply(tree, patch, "--check").returncode == 0:
            proc = git_apply(tree, patch)
            if proc.returncode != 0:
                raise SourceError(f"patch {patch.name} passed --check but failed:\n{proc.stderr}")
            applied.append(patch.name)
            log(f"empanel: applied {patch.name}")
        elif git_apply(tree, patch, "--check", "--reverse").returncode == 0:
            log(f"empanel: {patch.name} already applied, skipped")
        else:
            detail = git_apply(tree, patch, "--check", "--verbose").stderr.strip()
            raise SourceError(
                f"patch {patch.name} does not apply to the llama.cpp at {tree}:\n{detail}\n"
                "HINT: the patch was made for another llama.cpp; regenerate it against the "
                "pinned commit (empanel_gguf/abi/pins.py)."
            )
    return applied


def our_files(patches_dir):
    """{path in llama.cpp's tree: our source file} for every file under patches/files/."""
    root = Path(patches_dir) / FILES_DIR
    if not root.is_dir():
        return {}
    return {path.relative_to(root).as_posix(): path for path in sorted(root.rglob("*")) if path.is_file()}


def add_files(tree, files, log=print):
    """Copy our files into a llama.cpp tree; skip one already there with the same bytes, refuse one
    that would replace a file of llama.cpp's (or another version of ours). Returns those added."""
    tree = Path(tree)
    added = []
    for rel, path in files.items():
        target = tree / rel
        if target.exists() and target.read_bytes() == path.read_bytes():
            continue
        if target.exists():
            raise SourceError(
                f"patches/{FILES_DIR}/{rel} would replace llama.cpp's own {rel}: our files must be new "
                "files; change llama.cpp's files with a patch instead")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        added.append(rel)
    if added:
        log(f"empanel: added {len(added)} files of ours ({', '.join(added)})")
    return added


def sync_tree(src, dst):
    """Make dst equal src, rewriting only files whose bytes differ so that an incremental build
    recompiles only what a patch change touched."""
    src, dst = Path(src), Path(dst)
    wanted = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        if target.exists() and target.read_bytes() == path.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    for path in sorted(dst.rglob("*"), reverse=True):
        rel = path.relative_to(dst)
        if rel not in wanted and rel.name != STAMP:
            path.unlink() if not path.is_dir() else shutil.rmtree(path)



def prepare_stamp(pins, files, patches):
    """What a prepared tree is made from: the sdist, our files and the patches (a hash)."""
    h = hashlib.sha256(f"{PREPARE_FORMAT} {pins.LLAMA_CPP_PYTHON_SHA256}".encode())
    for rel, path in files.items():
        h.update(f"{FILES_DIR}/{rel}".encode() + b"\0" + path.read_bytes())
    for patch in patches:
        h.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return h.hexdigest()


def prepare(dest, patches_dir, log=print):
    """Make dest the pinned llama.cpp with our patches applied. Cheap when nothing changed."""
    pins = load_pins()
    dest = Path(dest)
    patches = sorted(Path(patches_dir).glob("*.patch"))
    files = our_files(patches_dir)
    stamp = prepare_stamp(pins, files, patches)
    if (dest / STAMP).exists() and (dest / STAMP).read_text() == stamp:
        log(f"empanel: llama.cpp at {dest} is up to date")
        return dest
    sdist = fetch_sdist(pins)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        fresh = Path(tmp) / "llama.cpp"
        n = extract_llama(sdist, fresh)
        log(f"empanel: extracted {n} files of llama.cpp {pins.LLAMA_COMMIT[:8]} from {sdist.name}")
        add_files(fresh, files, log=log)
        apply_patches(fresh, patches, log=log)
        if (dest / STAMP).exists():
            (dest / STAMP).unlink()
        dest.mkdir(parents=True, exist_ok=True)
        sync_tree(fresh, dest)
    (dest / STAMP).write_text(stamp)
    return dest


def write_cmake_vars(path):
    pins = load_pins()
    Path(path).write_text(
        f'set(EMPANEL_LLAMA_COMMIT "{pins.LLAMA_COMMIT}")\n'
        f'set(EMPANEL_LLAMA_CPP_PYTHON_VERSION "{pins.LLAMA_CPP_PYTHON_VERSION}")\n'
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="fetch, extract and patch llama.cpp into --dest")
    p.add_argument("--dest", required=True)
    p.add_argument("--patches", default=str(REPO / "patches"))
    p.add_argument("--cmake-vars", help="also write the pins as a CMake file here")
    c = sub.add_parser("cmake-vars", help="write the pins as a CMake file")
    c.add_argument("--out", required=True)
    a = sub.add_parser("apply", help="add our files (patches/files/) and apply patches to an existing llama.cpp tree")
    a.add_argument("--tree", required=True)
    a.add_argument("patches", nargs="+")
    sub.add_parser("fetch", help="fetch and verify the sdist; print its path")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.dest, args.patches)
            if args.cmake_vars:
                write_cmake_vars(args.cmake_vars)
        elif args.command == "cmake-vars":
            write_cmake_vars(args.out)
        elif args.command == "apply":
            add_files(args.tree, our_files(REPO / "patches"))
            apply_patches(args.tree, args.patches)
        else:
            print(fetch_sdist(load_pins()))
    except SourceError as e:
        print(f"empanel-gguf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
