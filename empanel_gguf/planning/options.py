"""Every MoE option, declared once: OPTIONS below.

Each Option gives a `moe_*` keyword of Llama its default, its check, the commands' flag and
LLAMA_ARG_* environment variable, and the help texts. From the table come:

    MoeOptions        the options of one load (moe_slots aside), a dataclass whose fields are
                      the keywords without "moe_", checked when made (ValueError naming the option)
    moe_options(**kw) MoeOptions from Llama's keywords; ValueError for an unknown moe_* name
    KEYWORDS          every keyword, moe_slots first (Llama's, in this order)
    llama_args_doc()  the options' part of Llama's docstring
    markdown()        docs/options.md (scripts/options_doc.py writes it; a test compares)

and commands/options.py makes the commands' arguments from OPTIONS. The pool's defaults and
bounds are csrc/empanel.h's (abi.header), the read paths its enum empanel_read_io.

Pure Python: it reads the header and loads no library.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass, field, make_dataclass
from typing import Optional, Union

from ..abi.header import ENGINE_POLICIES, READ_ALIGN, READ_IO, define
from .sizing import DEFAULT_POLICY, parse_size

READ_THREADS = define("EMPANEL_DEFAULT_READ_THREADS")  # reader threads besides the decoding thread
MAX_READ_THREADS = define("EMPANEL_MAX_READ_THREADS")
CHUNK_KB = define("EMPANEL_DEFAULT_CHUNK_KB")          # KiB per read request
MIN_CHUNK_KB = READ_ALIGN // 1024                      # the O_DIRECT block
MAX_CHUNK_KB = define("EMPANEL_MAX_CHUNK_KB")
QUEUE_DEPTH = define("EMPANEL_DEFAULT_QUEUE_DEPTH")    # io_uring reads in flight
MAX_QUEUE_DEPTH = define("EMPANEL_MAX_QUEUE_DEPTH")


# ---------------------------------------------------------------------------------------------
# the command line's parsers (text -> value)


def parse_bool(text):
    value = str(text).strip().lower()
    if value in ("1", "on", "true", "yes", "y", "enabled"):
        return True
    if value in ("0", "off", "false", "no", "n", "disabled", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use on/off)")


def auto_bool(text):
    """'auto' -> None, else on/off as parse_bool."""
    return None if str(text).strip().lower() == "auto" else parse_bool(text)


def parse_repack(text):
    """--moe-repack: auto, or a boolean."""
    return "auto" if str(text).strip().lower() == "auto" else parse_bool(text)


def parse_prefetch(text):
    """--moe-prefetch: auto, or a number of layers ahead (0: off)."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"not auto or a number of layers: {text!r}")


# ---------------------------------------------------------------------------------------------
# the checks (value -> value as the load takes it; ValueError says what is valid, without the name)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(low, high, what):
    def check(value):
        if not _is_int(value) or not low <= value <= high:
            raise ValueError(f"{what}, {low} to {high}")
        return value
    return check


def _one_of(choices, what):
    def check(value):
        if not isinstance(value, str) or value not in choices:
            raise ValueError(what)
        return value
    return check


def _profile(value):
    """"none", "off" and "" mean None (no profile)."""
    return None if isinstance(value, str) and value.strip().lower() in ("none", "off", "") else value


def _prefetch(value):
    if value != "auto" and (not _is_int(value) or value < 0):
        raise ValueError("'auto' or a number of layers ahead (0 = off)")
    return value


def _subst(value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
        raise ValueError("a ratio in (0, 1] (0.5: a stand-in needs half the missing expert's score), or None")
    return value


def _positive_size(value, forms):
    """value (bytes, or a size such as "4GiB") as bytes > 0; ValueError naming the forms."""
    size = value if _is_int(value) else parse_size(str(value))
    if size is None or size <= 0:
        raise ValueError(forms)
    return size


def _budget(value):
    return None if value is None else _positive_size(value, 'a size ("4GiB") or bytes of resident experts over '
                                                             "all layers, or None")


def _host_cache(value):
    return value if value is None or value == 0 else _positive_size(value, 'a size ("8GiB") or bytes of host '
                                                                             "memory, or None")


SLOTS_NONE = ("", "none", "off", "no", "false", "0")  # moe_slots texts that mean None: stock, no pools


def parse_slots(text):
    """--moe-slots: its form checked as the flag is read (a usage error before anything loads);
    plan.parse_moe_slots turns the text into moe_slots' value."""
    value = str(text).strip().lower()
    if value in SLOTS_NONE or value == "auto" or value.isdigit() or parse_size(value) is not None:
        return text
    if value.endswith("%"):
        try:
            float(value[:-1])
            return text
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"{text!r}: not auto, none, a count (32), a share (25%) or a size (6GiB)")


def parse_batch(text):
    """--moe-batch: auto, stock, or a number of tokens."""
    value = str(text).strip().lower()
    if value in ("auto", "stock"):
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"not auto, stock or a number of tokens: {text!r}")


def _batch(value):
    if value not in ("auto", "stock") and (not _is_int(value) or value < 1):
        raise ValueError("'auto', 'stock' or a number of tokens per micro-batch")
    return value


def _repack(value):
    if value != "auto" and not isinstance(value, bool):
        raise ValueError("'auto', True (llama.cpp's defaults: CPU repack buffers) or False (--no-repack: plain pools)")
    return value


# ---------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Option:
    name: str                 # Llama's keyword without "moe_" (a MoeOptions field)
    default: object           # Llama's default, and the commands'
    doc: str                  # what it does: Llama's docstring and docs/options.md
    help: str = ""            # the commands' --help text ("": no flag, the commands set it themselves)
    parse: object = None      # the command line's text -> value (None: the text)
    metavar: str | None = None
    choices: tuple | None = None
    check: object = None      # value -> value as the load takes it; ValueError says what is valid
    short: str | None = None  # a short flag too ("-ms")
    show_default: str | None = None  # what --help shows as the default, where not the value
    server: object = None     # the type of the server's setting (server.py; a config file's key), None: none

    @property
    def keyword(self):
        return f"moe_{self.name}"

    @property
    def flags(self):
        """The commands' flags ("-ms", "--moe-slots"); () without one."""
        if not self.help:
            return ()
        return ((self.short,) if self.short else ()) + (f"--moe-{self.name.replace('_', '-')}",)

    @property
    def env(self):
        """The LLAMA_ARG_* variable that gives the flag's default ("" without a flag)."""
        return f"LLAMA_ARG_{self.keyword.upper()}" if self.help else ""

    def checked(self, value):
        """value as the load takes it; ValueError naming the option. A switch given as text from
        Python ("off", "auto") is read as its flag's is, never as a true string."""
        if isinstance(value, str) and self.parse in (parse_bool, auto_bool):
            try:
                value = self.parse(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{self.keyword}={value!r}: {e}") from None
        if self.check is None:
            return value
        try:
            return self.check(value)
        except ValueError as e:
            raise ValueError(f"{self.keyword}={value!r}: {e}") from None


POLICIES = ("auto",) + tuple(ENGINE_POLICIES)
ON_OFF = "on|off"

OPTIONS = (
    Option("slots", None, parse=parse_slots, metavar="N|P%|SIZE|auto|none", short="-ms", show_default="auto",
           server=Optional[str],
           doc='slots per MoE layer: a count (32), a share of the experts ("25%"), a memory budget for all '
               'pools ("6GiB"), or "auto": every expert resident if the model fits in the available memory '
               "(minus a floor), else the most slots that fit. None: stock behaviour, every expert resident "
               '(the commands default to "auto").',
           help="expert slots per MoE layer: a count, a share of the experts, a budget for all "
                "pools (6GiB), auto (slot pools only if the experts do not fit in memory), or "
                "none (every expert resident)"),
    Option("policy", "auto", choices=POLICIES, server=str,
           check=_one_of(POLICIES, f"auto or one of {', '.join(ENGINE_POLICIES)}"),
           doc='which expert a full pool evicts: "auto" (the policy `empanel-gguf calibrate` ranked best for '
               f'this file at the planned slots, from its profile; else "{DEFAULT_POLICY}"), "lfu-decay" (per '
               'layer, the least used, counts halving over time), "lru" (per layer, the least recent), or '
               '"g-lru" (one budget for all layers, the least recent expert of any layer goes; host pools '
               "take memory only for the experts they hold).",
           help="which expert a full pool evicts: auto (the one `calibrate` ranked best for this "
                f"file at the planned slots, else {DEFAULT_POLICY}), lfu-decay (least used, decaying "
                "counts) and lru per layer, g-lru with one budget for all layers"),
    Option("io_threads", READ_THREADS, parse=int,
           check=_int_in(0, MAX_READ_THREADS, "reader threads besides the decoding thread"),
           doc="reader threads besides the decoding thread on the threads path (0: the decoding thread "
               "reads alone, in the remap, on either path).",
           help="expert reader threads besides the decoding thread (0: it reads alone)"),
    Option("chunk_kb", CHUNK_KB, parse=int, check=_int_in(MIN_CHUNK_KB, MAX_CHUNK_KB, "KiB per read request"),
           doc="KiB per read request; an expert is read in such chunks by all reader threads at once.",
           help="KiB per expert read request"),
    Option("read_io", "auto", choices=tuple(READ_IO),
           check=_one_of(tuple(READ_IO), "'auto', 'threads' (moe_io_threads threads, pread each) or 'uring' "
                                         "(one thread, io_uring at moe_queue_depth)"),
           doc='how reads are issued: "threads" (moe_io_threads threads, pread each), "uring" (one thread '
               "keeps moe_queue_depth reads in flight with io_uring; where the build or the kernel has none, "
               'the threads, with a notice) or "auto" (io_uring where there is one, measured faster with '
               "less CPU: docs/performance.md). EMPANEL_READ_IO=threads|uring overrides it; "
               'moe_stats()["read_io"] says which ran.',
           help="how reads are issued: threads (--moe-io-threads preads), uring (one thread, io_uring at "
                "--moe-queue-depth; the threads where there is none) or auto (the path measured best)"),
    Option("queue_depth", QUEUE_DEPTH, parse=int, check=_int_in(1, MAX_QUEUE_DEPTH, "read requests in flight"),
           doc="io_uring: read requests in flight at most.",
           help="io_uring: read requests in flight at most"),
    Option("direct_io", True, parse=parse_bool, metavar=ON_OFF,
           doc="read experts with O_DIRECT, bypassing the page cache (falls back to buffered reads with a "
               "notice where the file system refuses it).",
           help="read experts with O_DIRECT"),
    Option("trace", False,
           doc="record every token's routed experts in every MoE layer (moe_take_trace()), with or without "
               "slot pools; outputs are unchanged (the trace command sets it)."),
    Option("preload", None, parse=auto_bool, metavar="auto|on|off", show_default="auto",
           doc="read experts into the empty slots at load (a profile's most used first, else the lowest "
               "expert ids, as far as the slots and the g-lru budget go). None: when every pool holds all "
               "its layer's experts (resident from the first token, like a stock load) or a calibration "
               "profile is used (moe_profile); True: always; False: every expert is read on its first use.",
           help="read experts into the empty slots at load; auto: when the pools hold every expert or a "
                "calibration profile is used (--moe-profile)"),
    Option("resident_layers", 0, parse=int, metavar="N", server=int,
           doc="the first N MoE layers keep every expert in memory, as a stock load does (llama.cpp users "
               "know the idea from --n-cpu-moe); the others get slot pools. A size for moe_slots covers the "
               "resident layers' experts too.",
           help="the first N MoE layers keep every expert in memory (no pool)"),
    Option("profile", "auto", metavar="auto|PATH|none", check=_profile, server=Optional[str],
           doc="a calibration profile (empanel-gguf calibrate) whose most used experts fill the empty slots "
               'at load: "auto" uses the saved profile of this model file if there is one, a path uses that '
               'file (refused if it is another model\'s), None (or "none") starts cold.',
           help="warm start from a calibration profile (empanel-gguf calibrate): auto uses this model "
                "file's saved one if there is one"),
    Option("guess", None, parse=auto_bool, metavar="auto|on|off", show_default="auto",
           doc="the gate-ahead guess: while a layer runs a micro-batch that fits its pools, the next "
               "layer's router is applied to this layer's FFN input; the experts it names are evicted last "
               "by the next layer. Costs one small matmul per layer, no reads; outputs are unchanged. None "
               "(auto): on, except where RPC servers are registered: there the guess computed on a host is "
               "read back, a round trip per layer, for 0.2 % of hit rate (docs/rpc.md). "
               "moe_prefetch > 0 turns it on.",
           help="the gate-ahead guess: the next layer's router on this layer's input; its experts are "
                "evicted last (no reads); auto (default): on, except with RPC servers (a round trip per layer)"),
    Option("prefetch", "auto", parse=parse_prefetch, metavar="auto|N", check=_prefetch,
           server=Union[int, str],
           doc="N > 0 also reads the guessed experts that are not resident while the layer N or fewer "
               "layers before computes (in a lane of their own behind the layer's own reads, the likeliest "
               "guesses first); when the guessed layer's remap comes, the reads of guesses it does not route "
               'to are dropped unread. "auto" and 0: none (measured slower on the real shapes under a cap: '
               "its reads cost the cores that compute more than the waits they hid where routing is spread, "
               "and tied where it is skewed: docs/performance.md); N where `bench` measures it faster on "
               "your machine. A prompt's waves read the next layer's empty slots either way, where host "
               "pools page under a per-layer policy (EMPANEL_PROMPT_AHEAD=0 turns that off).",
           help="also read the guessed experts that are not resident, N layers ahead, behind the layer's own "
                "reads; reads of guesses the layer does not route to are dropped when it comes. auto (default): "
                "0, none (measured slower on the real shapes here: docs/performance.md)"),
    Option("subst", None, parse=float, metavar="R", check=_subst, server=Optional[float],
           doc="routing substitution, opt-in and INEXACT: a ratio r in (0, 1]. When a routed expert is not "
               "resident, the best resident expert among the router's next top-k choices stands in if its "
               "score is at least r x the missing one's, with its own routing weight. Saves reads, changes "
               "outputs (measure with empanel-gguf kl). None: exact.",
           help="routing substitution, INEXACT: a resident expert among the router's next choices stands "
                "in for a missing one if its score is at least R x the missing one's (empanel-gguf kl "
                "measures the cost)"),
    Option("verify", False, parse=parse_bool, metavar=ON_OFF, server=bool,
           doc="check every expert read against its XXH3-64 digest before it is used (a mismatch fails the "
               "decode with MoeReadError): the digests `empanel-gguf verify` saved for this file, else each "
               "expert's first read. Outputs unchanged.",
           help="check every expert read against its XXH3-64 digest (those empanel-gguf verify saved, else "
                "its first read's); a mismatch fails the decode"),
    Option("repack", "auto", parse=parse_repack, metavar="auto|on|off", check=_repack,
           doc='the weight layout. "auto": stock\'s defaults (CPU repack buffers) where the pools hold '
               "every expert, and none where they page, as llama.cpp's --no-repack (use_extra_bufts=False), "
               "pools included: reads land in the slots, nothing is repacked; measured faster when paging "
               "(docs/performance.md), unless `empanel-gguf layout` measured repacked pools faster on this "
               'machine (moe_stats()["layout_why"] says which chose). True / False force one. Outputs equal '
               'stock loaded with the same layout; moe_stats()["exact_to"] names it.',
           help="auto (default): stock's CPU repack buffers where the pools hold every expert, none where they "
                "page (plain pools: reads land in the slots, nothing is repacked; faster there, unless "
                "`empanel-gguf layout` measured otherwise on this machine); on: stock's "
                "defaults always; off: as llama.cpp's --no-repack always. The report names the stock command "
                "the outputs equal"),
    Option("batch", "auto", parse=parse_batch, metavar="auto|stock|N", check=_batch,
           doc='the micro-batch where the pools page. "auto": a prompt goes in calls of up to 2,048 tokens '
               "(at most n_ctx), each one micro-batch (n_batch = n_ubatch) with flash attention, so that "
               "each expert is read once per call instead of once per 512 tokens; of 2,048, 1,024 and 512 "
               "tokens it takes the largest whose compute buffer costs the pools no more than 3 % more misses "
               "than the best plan, llama-cpp-python's own 512 among them (decode never pays for prompts); it "
               "applies where the pools page in host memory, n_ctx is above 512 and none of n_batch, n_ubatch "
               "and flash_attn is given (those keep what they ask). N: that many tokens (flash attention on unless "
               'flash_attn is given). "stock": llama-cpp-python\'s own settings. Outputs equal stock '
               "llama.cpp with the same -b, -ub and -fa; moe_stats()[\"exact_to\"] names them.",
           help="the micro-batch where the pools page: auto (default) evaluates a prompt in calls of up to "
                "2048 tokens, one micro-batch each with flash attention (each expert read once per call); "
                "stock: the usual 512; N: that many tokens. -b, -ub or -fa given keep theirs"),
    Option("elastic", None, parse=auto_bool, metavar="auto|on|off", show_default="auto",
           doc="pools that give memory back: a controller in the sidecar watches the memory limit that binds "
               "(the memory cgroup, else MemAvailable) and lowers the live budget of resident experts at once "
               "when another program needs memory, raising it again slowly when memory is free; outputs do "
               'not change. None: on where moe_slots is "auto" and the pools page in host memory; True: for '
               "any moe_slots; False: the pools keep their memory. Elastic \"auto\" pools get slots for the "
               "whole limit as if the load were alone (address space reserved without commit) and a budget "
               "that starts at what is free at load: they grow into memory freed later. Pools in device "
               "memory (a GPU) and pools that hold every expert in place never give back. "
               'moe_stats()["budget"] reports it.',
           help="pools that give memory back when another program needs it and take it again when it is free "
                "(outputs unchanged); auto: with --moe-slots auto on host pools"),
    Option("budget", None, metavar="SIZE", check=_budget, server=Optional[str],
           doc='the live budget at load: bytes (or a size, "4GiB") of resident experts over all layers, below '
               "the pools' capacity (their slots); Llama.moe_set_budget moves it while the model runs, and "
               "moe_elastic moves it with the memory left, from there up to the capacity. None: the capacity "
               "(g-lru: its shared budget; elastic \"auto\" pools: what was free at load). "
               "Never below the top-k experts of every MoE layer.",
           help="the live budget of resident experts at load (e.g. 4GiB), below the pools' capacity; "
                "moe_elastic moves it with the memory left"),
    Option("host_cache", None, metavar="SIZE", check=_host_cache,
           doc='a host-RAM tier for pools in device memory (layers offloaded to a GPU), as a size ("16GiB") '
               "or bytes: experts the pools read stay in host memory (pinned where the backend offers it), "
               "and a miss is written from there before the drive is asked. None: no tier. Refused where the "
               "pools are in host memory already, and on a unified-memory device (an integrated GPU, Metal), "
               "where it would hold every cached expert twice, unless moe_host_cache_unified=True. "
               "moe_stats() counts host_hits and host_bytes.",
           help="a host-RAM tier for pools in device memory (offloaded layers): experts they read stay in "
                "host memory and a miss is served from there before the drive (e.g. 16GiB)"),
    Option("host_cache_unified", False, parse=parse_bool, metavar=ON_OFF,
           doc="keep the host tier even on a unified-memory GPU (integrated, Metal), where it holds every "
               "cached expert twice.",
           help="keep the host tier even on a unified-memory GPU (integrated, Metal), where it holds every "
                "cached expert twice"),
    Option("mtp", False,
           doc="load the file's MTP (\"nextn\") blocks as llama.cpp does for MTP drafting "
               "(llama_model_params.load_mtp; --spec-type draft-mtp in its programs, which do it "
               "themselves), with or without slots. Their MoE layers then get pools like the others. False: "
               "llama.cpp skips the blocks, and so do the pools (no pool, no memory, no reads; "
               "docs/architectures.md)."),
)

OPTION = {o.name: o for o in OPTIONS}
KEYWORDS = tuple(o.keyword for o in OPTIONS)  # moe_slots first
LOAD_OPTIONS = tuple(o for o in OPTIONS if o.name != "slots")  # MoeOptions' (moe_slots is planned apart)


def env_options(environ):
    """The moe_* keywords (moe_slots aside) that the flags' variables give (LLAMA_ARG_MOE_*, set
    in `environ`), parsed as their flags are: how `empanel-gguf exec` hands options to a program's
    Llama(...) calls."""
    out = {}
    for o in LOAD_OPTIONS:
        text = environ.get(o.env) if o.env else None
        if text not in (None, ""):
            out[o.keyword] = o.parse(text) if o.parse is not None else text
    return out


def _check_all(self):
    """MoeOptions.__post_init__: every value checked (ValueError naming the option), as the load
    takes it."""
    for o in LOAD_OPTIONS:
        setattr(self, o.name, o.checked(getattr(self, o.name)))


# the options of one load, moe_slots aside: a dataclass made from the table, checked when made
# (and when dataclasses.replace makes another)
MoeOptions = make_dataclass(
    "MoeOptions", [(o.name, object, field(default=o.default)) for o in LOAD_OPTIONS],
    namespace={"__post_init__": _check_all,
               "__doc__": "How the pools run: Llama's moe_* arguments other than moe_slots (the same names "
                          "without the prefix, the same defaults), from planning/options.py's table."})
MoeOptions.__module__ = __name__


def did_you_mean(unknown, known):
    """"; did you mean X, Y?" with the nearest known name of each unknown one, or "" if none is near."""
    import difflib

    close = [match for name in unknown for match in difflib.get_close_matches(name, known, n=1)]
    return f"; did you mean {', '.join(close)}?" if close else ""


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose error for an option it does not know names the nearest it knows."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            unknown = [arg.split("=", 1)[0] for arg in message.split(": ", 1)[1].split() if arg.startswith("-")]
            message += did_you_mean(unknown, [o for a in self._actions for o in a.option_strings])
        super().error(message)


def check_known(keywords):
    """ValueError for a moe_* name that is no option, naming the valid ones."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        hint = did_you_mean(unknown, KEYWORDS)
        raise ValueError(f"unknown MoE option{'s' * (len(unknown) > 1)} {', '.join(unknown)}{hint} (the options: "
                         f"{', '.join(KEYWORDS)})")


def moe_options(**moe_kwargs) -> MoeOptions:
    """MoeOptions from Llama's keyword names (moe_policy=..., moe_profile=...), checked. A
    moe_profile of "none"/"off"/"" means None. ValueError for an unknown moe_* name (naming the
    valid ones; moe_slots is planned apart) or a value out of range (naming the option)."""
    check_known(moe_kwargs)
    if "moe_slots" in moe_kwargs:
        raise ValueError("moe_slots is planned apart: plan_load(index, moe_slots, options=moe_options(...))")
    return MoeOptions(**{key[len("moe_"):]: value for key, value in moe_kwargs.items()})


# ---------------------------------------------------------------------------------------------
# the texts made from the table


def _default_text(o):
    return repr(o.default)


def llama_args_doc(indent=8, width=104):
    """The Args lines of Llama's docstring: one entry per option, its default last."""
    lines = []
    for o in OPTIONS:
        text = f"{o.keyword}: {o.doc} Default: {_default_text(o)}."
        lines += textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
    return "\n".join(lines)


def _cell(text):
    return text.replace("|", "\\|")


def markdown():
    """docs/options.md: every option, its default, flag and environment variable, what it does."""
    rows = []
    for o in OPTIONS:
        if o.flags:
            value = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else o.name.upper())
            cli = f"`{' '.join(o.flags[:-1] + (o.flags[-1] + ' ' + value,))}`<br>`{o.env}`"
        else:
            cli = "(none)"
        default = f"`{_default_text(o)}`" + (f" (commands: `{o.show_default}`)" if o.show_default else "")
        rows.append(f"| `{o.keyword}` | {_cell(cli)} | {default} | {_cell(o.doc)} |")
    return "\n".join([
        "# The MoE options",
        "",
        "<!-- made by scripts/options_doc.py from empanel_gguf/planning/options.py; edit the table there -->",
        "",
        "`Llama(path, moe_slots=..., moe_policy=..., ...)` takes these keywords besides every",
        "`llama_cpp.Llama` argument; a misspelt `moe_*` keyword is a `ValueError` naming the valid",
        "ones, and a value out of range one naming the option. The commands (`run`, `trace`, and",
        "llama.cpp's programs under `empanel-gguf`) take each as a flag, whose default an environment",
        "variable in llama.cpp's style gives (`--help` lists them); `empanel-gguf serve` takes",
        ", ".join(f"`{o.keyword}`" for o in OPTIONS if o.server is not None) + " as settings (`--moe_slots`, or",
        "in each model of a config file). The pool's defaults and bounds are csrc/empanel.h's: reader",
        f"threads 0 to {MAX_READ_THREADS}, KiB per read request {MIN_CHUNK_KB} to {MAX_CHUNK_KB}, io_uring reads",
        f"in flight 1 to {MAX_QUEUE_DEPTH}.",
        "",
        "| keyword | flag, environment variable | default | what it does |",
        "|---|---|---|---|",
        *rows,
        "",
        "Besides these, `Llama` takes `rpc_servers` (`\"HOST:PORT,...\"` of `ggml-rpc-server`s: the",
        "offloaded layers and their pools go there; [rpc.md](rpc.md)) and `moe_load` (a load planned",
        "beforehand with `plan.plan_load(...)`, as the commands do: loaded as planned, nothing planned",
        "again).",
        "",
    ])
