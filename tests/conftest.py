"""Every test runs with a profile cache of its own session: a profile the user saved with
`empanel-gguf calibrate` (moe_profile="auto" finds it) must not change what the tests measure."""

import os
import tempfile

_PROFILES = tempfile.mkdtemp(prefix="empanel-test-profiles-")
os.environ["EMPANEL_PROFILE_DIR"] = _PROFILES  # read by empanel_gguf.profile.cache_dir, children too
