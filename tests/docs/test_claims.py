"""What the docs say about defaults matches the code, and the docs address their readers, not an issue
tracker."""

from __future__ import annotations

import re

from sigmaflight.wire import RolloutRequest, Sampler
from tests.docs.markdown import PAGES, ROOT

SAMPLER_TYPES = ("sde", "cps", "ode")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.:;])\s+|\n\n", text.replace("\n", " ")) if s.strip()]


def test_sentences_about_the_default_sampler_name_the_wire_default():
    default = Sampler()
    assert RolloutRequest().sampler == default  # a request without `sampler` runs this one
    claims = []
    for page in PAGES:
        for sentence in _sentences(page.read_text()):
            low = sentence.lower()
            if "default" in low and "sampler" in low:
                named = {t for t in SAMPLER_TYPES if re.search(rf"[\"'`]{t}[\"'`]", sentence)}
                claims.append((page.name, sentence))
                assert named <= {default.type}, f"{page.relative_to(ROOT)}: {sentence!r} names {named}"
    recipes = (ROOT / "docs" / "recipes.md").read_text()
    assert re.search(rf"[\"`]+{default.type}[\"`]+ with noise_level {re.escape(str(default.noise_level))}", recipes)
    assert any(name == "recipes.md" for name, _ in claims)


def test_no_page_talks_about_an_issue_instead_of_to_its_reader():
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.search(r"\bthe issue\b|\bissue \d+", line, re.IGNORECASE), f"{page.relative_to(ROOT)}:{n}: {line}"


def test_the_life_of_a_rollout_names_only_functions_that_exist_in_the_modules_it_names():
    """docs/control.md "Life of a rollout" follows a request through the code: each `Name` or
    `Class.method` it cites is defined (def, class, or assigned) in the server's or users' code, and
    each module path it names exists, so a rename cannot leave the walk-through pointing nowhere."""
    text = (ROOT / "docs" / "control.md").read_text()
    section = text.split("## Life of a rollout", 1)[1].split("\n## ", 1)[0]
    source = "\n".join(p.read_text() for d in ("control", "dataplane", "pipeline", "sigmaflight")
                       for p in (ROOT / d).rglob("*.py"))
    defined = set(re.findall(r"^\s*(?:async def|def|class)\s+(\w+)", source, re.MULTILINE))
    defined |= set(re.findall(r"^\s*(?:self\.)?(\w+)\s*(?::[^=\n]+)?=", source, re.MULTILINE))
    not_ours = {"model_validate", "from_json", "extra_info", "stat", "loc", "queue_full"}  # pydantic(-core), pyarrow, os; wire words
    for path in re.findall(r"\b((?:control|dataplane|pipeline|sigmaflight)/[\w/]+\.py)\b", section):
        assert (ROOT / path).is_file(), f"Life of a rollout names {path}, which does not exist"
    names = [n for n in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", section) if "/" not in n]
    assert len(names) > 60
    missing = sorted({n for n in names if n.rsplit(".", 1)[-1] not in defined | not_ours})
    assert not missing, f"Life of a rollout cites names the code does not define: {missing}"
