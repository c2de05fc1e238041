"""What the docs say about defaults matches the code, and the docs address their readers, not an issue
tracker (issue 21 item 8)."""

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
