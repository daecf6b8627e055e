"""Calibration profiles: how often each expert of each MoE layer was used on some text, for a warm
start (empanel-gguf calibrate, commands/calibrate.py; Llama(moe_profile=...)).

A profile is a small JSON file tied to one model file by its identity:

    {"format": "empanel-gguf-profile", "version": 1,
     "model": {"name": ..., "size": bytes, "header_sha256": ...},   # the identity
     "n_expert": E, "n_expert_used": k, "moe_layers": [il, ...],
     "tokens": n,                                                    # tokens routed
     "counts": [[uses of expert 0..E-1] per MoE layer, in moe_layers order],
     "policies": {"slots": [s, ...], "hit_rate": {policy: [rate at each s]}}}   # optional

`policies` is calibrate's replay of the engine's eviction policies over the text's routing, one
token at a time (as decode calls them) at several slot counts; moe_policy="auto" takes the best
at the planned slots (choose_policy).

The identity is the file's size and a SHA-256 of its header (cache.file_identity): a
re-quantized or re-exported model has another one; the same file copied elsewhere keeps it.
`moe_profile="auto"` looks for a saved profile of the model's
identity in the cache (EMPANEL_PROFILE_DIR, else ~/.cache/empanel-gguf/profiles or under
$XDG_CACHE_HOME). With a profile, the
empty slots are filled at load with each layer's most used experts instead of the lowest ids.
The profile orders what is read first; outputs are unchanged either way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import cached_path, file_identity

FORMAT = "empanel-gguf-profile"
VERSION = 1

# the text `calibrate` routes when none is given: plain prose of several kinds, ~900 words
DEFAULT_TEXT = """\
The river rose in the night, and by morning the lower fields were under water. The farmers who had
planted early stood at the edge of the flood and counted what was lost; those who had waited said
little, for they knew their turn might come with the next storm. In the town the bakers opened as
usual, the bells rang at seven, and the children went to school along the high road, which the
water never reached.

To install the package, download the archive, unpack it into a folder of your choice and run the
setup script from that folder. The script checks that a compiler is present, builds the native
library, and copies the result next to the Python files. If the build fails, read the last lines
of the log: they name the missing header or the command that failed, and what to install instead.

Photosynthesis converts light energy into chemical energy stored in sugars. In the light reactions,
water is split and oxygen is released; the energy captured drives the synthesis of ATP and NADPH.
In the Calvin cycle these carriers fix carbon dioxide into three-carbon molecules, which the plant
then assembles into glucose, starch and cellulose.

"Where were you last night?" she asked, without looking up from the letter.
"At the station," he said. "The train was late again, and then there was no cab."
"There is always a cab," she said, and folded the letter twice, and put it in her pocket.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values) if values else 0.0

The committee met on Tuesday to review the budget for the coming year. Revenue rose four percent,
mostly from fees; costs rose six percent, most of it wages and energy. The treasurer proposed to
delay the new roof by a year and to draw on the reserve for the difference. After a long debate the
proposal passed by seven votes to three, with two members absent.

Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds
that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows bound with
victorious wreaths, our bruised arms hung up for monuments, our stern alarums changed to merry
meetings, our dreadful marches to delightful measures.

Q: How many minutes are there in a week?
A: Seven days of twenty-four hours of sixty minutes each: 7 x 24 x 60 = 10,080 minutes.
Q: And seconds?
A: Sixty times as many: 604,800 seconds.

The old lighthouse keeper kept a log of every ship that passed, its flag, its course and the hour,
in a hand that grew smaller as the years went by. When the light was automated the log was taken
to the museum, where visitors turn its pages under glass and wonder who he was writing for.
"""


class ProfileError(ValueError):
    """A profile that cannot be used for this model (another file, another shape, not a profile)."""


@dataclass
class Profile:
    model: dict          # identity of the model file (file_identity)
    n_expert: int
    n_expert_used: int
    moe_layers: list     # MoE layer ids, ascending
    tokens: int          # tokens routed
    counts: np.ndarray   # int64 [len(moe_layers), n_expert]: uses of each expert
    policies: dict | None = None  # {"slots": [...], "hit_rate": {policy: [...]}} (calibrate's replay)

    def order(self, layer):
        """The layer's experts, most used first (ties: lower id first)."""
        row = self.counts[self.moe_layers.index(layer)]
        return sorted(range(self.n_expert), key=lambda e: (-int(row[e]), e))

    def choose_policy(self, slots, preferred):
        """(policy, hit rates at the replayed slot count nearest `slots`) with the highest hit rate
        there (ties: `preferred` first), or None without a replay."""
        ranking = self.policies or {}
        sizes, rates = ranking.get("slots") or [], ranking.get("hit_rate") or {}
        if not sizes or not rates:
            return None
        i = min(range(len(sizes)), key=lambda j: (abs(sizes[j] - slots), sizes[j]))
        at = {name: row[i] for name, row in rates.items()}
        best = max(at, key=lambda name: (at[name], name == preferred))
        return best, sizes[i], at

    def to_json(self):
        doc = {"format": FORMAT, "version": VERSION, "model": self.model, "n_expert": self.n_expert,
               "n_expert_used": self.n_expert_used, "moe_layers": self.moe_layers, "tokens": self.tokens,
               "counts": self.counts.tolist()}
        if self.policies:
            doc["policies"] = self.policies
        return doc


def default_path(index, identity=None):
    """Where `calibrate` saves the profile of this model file, and where "auto" looks."""
    return cached_path(identity or file_identity(index), ".json")


def count_routing(records, moe_layers, n_expert):
    """Uses per (MoE layer, expert) in the sidecar's routing records ([layer, n_tokens, n_used,
    ids...] per remap call, Llama.moe_take_trace())."""
    counts = np.zeros((len(moe_layers), n_expert), dtype=np.int64)
    row_of = {il: j for j, il in enumerate(moe_layers)}
    i = 0
    while i < len(records):
        il, n_tokens, n_used = int(records[i]), int(records[i + 1]), int(records[i + 2])
        ids = records[i + 3:i + 3 + n_tokens * n_used]
        np.add.at(counts[row_of[il]], ids[ids >= 0], 1)
        i += 3 + n_tokens * n_used
    return counts


def save_profile(profile, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_json()))
    os.replace(tmp, path)
    return path


def load_profile(path, index, identity=None):
    """The profile at `path`, checked against the model (ProfileError if it is another file's)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: not a readable profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ProfileError(f"{path}: not an {FORMAT} file of version {VERSION}")
    identity = identity or file_identity(index)
    if data.get("model") != identity:
        theirs = data.get("model") or {}
        raise ProfileError(
            f"{path} is the profile of {theirs.get('name', '?')} ({theirs.get('size', '?')} bytes, header "
            f"{str(theirs.get('header_sha256', '?'))[:12]}), not of {identity['name']} ({identity['size']} "
            f"bytes, header {identity['header_sha256'][:12]}): calibrate this model "
            f"(empanel-gguf calibrate {index.path})")
    counts = np.asarray(data.get("counts"), dtype=np.int64)
    if (data.get("moe_layers") != index.moe_layers or data.get("n_expert") != index.n_expert
            or counts.shape != (len(index.moe_layers), index.n_expert)):
        raise ProfileError(f"{path}: its layers or experts do not match {index.path}")
    return Profile(model=data["model"], n_expert=data["n_expert"], n_expert_used=data["n_expert_used"],
                   moe_layers=data["moe_layers"], tokens=int(data.get("tokens", 0)), counts=counts,
                   policies=_policies(data.get("policies"), path))


def _policies(ranking, path):
    """A profile's policy ranking, checked (ProfileError if malformed), or None."""
    if ranking is None:
        return None
    ok = isinstance(ranking, dict) and isinstance(ranking.get("slots"), list) and isinstance(ranking.get("hit_rate"), dict)
    ok = ok and all(isinstance(n, int) for n in ranking["slots"]) and all(
        isinstance(row, list) and len(row) == len(ranking["slots"]) and all(isinstance(x, (int, float)) for x in row)
        for row in ranking["hit_rate"].values())
    if not ok:
        raise ProfileError(f"{path}: its policy ranking is malformed: calibrate again")
    return ranking


def resolve(index, moe_profile):
    """moe_profile (None, "auto", or a path) -> (Profile or None, where it came from). "auto":
    the cached profile of this model file, if there is one."""
    if moe_profile is None or moe_profile is False:
        return None, None
    if moe_profile == "auto":
        identity = file_identity(index)
        path = default_path(index, identity)
        if not path.is_file():
            return None, None
        return load_profile(path, index, identity), path
    return load_profile(moe_profile, index), Path(moe_profile)
