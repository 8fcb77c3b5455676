"""The simulated policy: per video and epoch, a GRPO group of seeded rollouts.

A rollout looks the video over (`video_info`, a retrieval for an activity one of the options
names, frames sampled over the whole video), then investigates one to three windows that the
retrieval ranks high, either by captioning the window's frames or by cutting it into a clip and
narrating the clip, sometimes keeps a note and retrieves again, then answers. Choices are
Zipf-weighted over a few candidates, so the rollouts of a group share their start and repeat each
other's calls in varying order, as samples of one prompt do; the policy answers right more often
in later epochs. Candidate windows come from the retrieval tool's own ranking (tools.retrieve) on
the fresh video, as if the policy had read its answer.
"""

from __future__ import annotations

import random
from typing import Any

from .footage import PLACES, Footage
from .tools import retrieve

Call = dict[str, Any]
INVESTIGATION_S = 30  # the window a rollout captions or cuts, from a retrieved window's start


def call(tool: str, **args: Any) -> Call:
    return {"tool": tool, "args": args}


def queries(footage: Footage) -> list[str]:
    """What the policy searches for: each place and activity the options name, in the order the
    options (A to E) first name them."""
    named = []
    for letter in sorted(footage.question["options"]):
        text = footage.question["options"][letter]
        found = [(text.find(a), p, a) for p in sorted(PLACES) for a in PLACES[p]["activities"] if a in text]
        for _, place, activity in sorted(found):
            query = f"{activity} {place}"
            if query not in named:
                named.append(query)
    return named


def _zipf(rng: random.Random, items: list[Any]) -> Any:
    return rng.choices(items, weights=[1 / (rank + 1) for rank in range(len(items))])[0]


class VideoPolicy:
    """The seeded rollouts of one video."""

    def __init__(self, footage: Footage, seed: int):
        self.footage = footage
        self.seed = seed
        self.queries = queries(footage)
        duration = footage.duration_s
        self.windows = {
            q: [
                (w["start_s"], min(w["start_s"] + INVESTIGATION_S, duration))
                for w in retrieve(list(footage.frames), [], q, 3)
            ]
            for q in self.queries
        }

    def rollout(self, epoch: int, index: int) -> list[Call]:
        rng = random.Random(f"{self.seed}-{self.footage.video}-{epoch}-{index}")
        duration = self.footage.duration_s
        calls = [call("video_info")] if rng.random() < 0.85 else []
        query = _zipf(rng, self.queries)
        calls.append(call("retrieve_clip", query=query, top_k=3))
        calls.append(call("sample_frames", start_s=0, end_s=duration, count=rng.choice([8, 8, 16])))
        window = (0, min(INVESTIGATION_S, duration))
        for k in range(rng.choice([1, 2, 2, 3])):
            candidates = self.windows[query] if rng.random() < 0.7 else self.windows[_zipf(rng, self.queries)]
            window = _zipf(rng, candidates) if candidates else window
            start, end = window
            if rng.random() < 0.5:
                calls.append(call("caption_frames", start_s=start, end_s=end))
            else:
                calls.append(call("extract_clip", start_s=start, end_s=end, name=f"clip{k}"))
                calls.append(call("caption_clip", name=f"clip{k}"))
            if rng.random() < 0.25:
                calls.append(call("sample_frames", start_s=start, end_s=end, count=4))
        if rng.random() < 0.35:
            start, end = window
            activity = self.footage.frames[start]["activity"]
            calls.append(call("annotate", start_s=start, end_s=end, text=f"{activity} here"))
            calls.append(call("retrieve_clip", query=_zipf(rng, self.queries), top_k=3))
        if rng.random() < 0.2:
            calls.append(call("video_info"))
        right = self.footage.question["answer"]
        if rng.random() < min(0.9, 0.5 + 0.15 * epoch):
            option = right
        else:
            option = rng.choice(sorted(set(self.footage.question["options"]) - {right}))
        calls.append(call("answer", option=option))
        return calls
