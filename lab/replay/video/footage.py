"""Generated long videos: a folder of frames per task, and its multiple-choice question.

A video is a sequence of scenes (a place, an activity, the objects at hand) filmed by the camera
wearer "C", sampled at one frame per second as EgoSchema's three-minute egocentric clips are used.
Each frame is a JSON file holding what a vision model reads off the picture (place, activity,
objects, hands, gaze, motion) and an 8x6 grayscale thumbnail the tools compute brightness from.
The question asks which activities fill the video, in order, with five options. Everything is a
pure function of the seed and the video's index.

    <folder>/meta.json           {"video", "fps", "frames", "duration_s"}
    <folder>/question.json       {"question", "options": {"A".."E"}, "answer"}
    <folder>/frames/000123.json  one frame
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FPS = 1
LETTERS = ("A", "B", "C", "D", "E")
THUMB_W, THUMB_H = 8, 6

PLACES: dict[str, dict[str, Any]] = {
    "kitchen": {
        "activities": ["chopping vegetables", "washing dishes", "stirring a pot", "kneading dough"],
        "objects": ["knife", "cutting board", "onion", "pan", "sink", "sponge", "pot", "spoon", "flour", "bowl"],
        "gaze": "down at the counter",
        "light": 170,
    },
    "garage": {
        "activities": ["fixing a bicycle", "sorting screws", "sanding a plank", "oiling a chain"],
        "objects": ["wrench", "bicycle", "screwdriver", "sandpaper", "workbench", "toolbox", "chain", "plank"],
        "gaze": "at the workbench",
        "light": 95,
    },
    "garden": {
        "activities": ["watering plants", "pulling weeds", "planting seedlings", "raking leaves"],
        "objects": ["watering can", "hose", "trowel", "seedling tray", "rake", "gloves", "wheelbarrow", "pot"],
        "gaze": "at the ground",
        "light": 210,
    },
    "living room": {
        "activities": ["folding laundry", "vacuuming the rug", "tidying the bookshelf", "playing a board game"],
        "objects": ["sofa", "laundry basket", "towel", "vacuum cleaner", "bookshelf", "dice", "cushion", "lamp"],
        "gaze": "across the room",
        "light": 140,
    },
    "office": {
        "activities": ["typing on a laptop", "sorting papers", "drawing a diagram", "reading a report"],
        "objects": ["laptop", "notebook", "pen", "stapler", "printer", "mug", "folder", "monitor"],
        "gaze": "at the desk",
        "light": 155,
    },
}
HANDS = ("both hands", "the right hand", "the left hand")


@dataclass(frozen=True)
class Scene:
    start_s: int
    end_s: int  # exclusive
    place: str
    activity: str
    objects: tuple[str, ...]

    @property
    def seconds(self) -> int:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Footage:
    """One video: its scenes, its frames and its question."""

    video: str
    scenes: tuple[Scene, ...]
    frames: tuple[dict[str, Any], ...]
    question: dict[str, Any]

    @property
    def duration_s(self) -> int:
        return len(self.frames) // FPS

    def meta(self) -> dict[str, Any]:
        return {"video": self.video, "fps": FPS, "frames": len(self.frames), "duration_s": self.duration_s}

    def write(self, folder: Path) -> None:
        (folder / "frames").mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").write_text(json.dumps(self.meta(), sort_keys=True))
        (folder / "question.json").write_text(json.dumps(self.question, sort_keys=True))
        for frame in self.frames:
            (folder / frame_path(frame["frame"])).write_text(json.dumps(frame, sort_keys=True))

    def digest(self) -> str:
        """Names the folder's content: part of the task's environment fingerprint."""
        body = json.dumps([self.meta(), self.question, list(self.frames)], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


def frame_path(index: int) -> str:
    return f"frames/{index:06d}.json"


def generate(seed: int, index: int) -> Footage:
    rng = random.Random(f"video-{seed}-{index}")
    scenes = _scenes(rng)
    frames = tuple(_frame(rng, scene, t) for scene in scenes for t in range(scene.start_s, scene.end_s))
    return Footage(f"ego{index}", tuple(scenes), frames, _question(rng, scenes))


def _scenes(rng: random.Random) -> list[Scene]:
    """8 to 12 scenes of 15 to 40 s; about half of them in the video's main place."""
    main = rng.choice(sorted(PLACES))
    scenes, start = [], 0
    for _ in range(rng.randint(8, 12)):
        place = main if rng.random() < 0.55 else rng.choice(sorted(PLACES))
        spec = PLACES[place]
        seconds = rng.randint(15, 40)
        objects = tuple(rng.sample(spec["objects"], rng.randint(3, 5)))
        scenes.append(Scene(start, start + seconds, place, rng.choice(spec["activities"]), objects))
        start += seconds
    return scenes


def _frame(rng: random.Random, scene: Scene, t: int) -> dict[str, Any]:
    spec = PLACES[scene.place]
    visible = sorted(rng.sample(scene.objects, rng.randint(2, len(scene.objects))))
    light = spec["light"] + rng.randint(-20, 20)
    thumb = bytes(max(0, min(255, light + rng.randint(-40, 40))) for _ in range(THUMB_W * THUMB_H))
    return {
        "frame": t * FPS,
        "t_s": t,
        "place": scene.place,
        "activity": scene.activity,
        "objects": visible,
        "hands": rng.choices(HANDS, weights=(5, 3, 2))[0],
        "gaze": spec["gaze"],
        "motion": round(rng.uniform(0.05, 0.95), 2),
        "thumb": thumb.hex(),
    }


def _summary(steps: list[tuple[str, str]]) -> str:
    (p1, a1), (p2, a2), (p3, a3) = steps
    return f"C is {a1} in the {p1}, then {a2} in the {p2}, and later {a3} in the {p3}"


def _question(rng: random.Random, scenes: list[Scene]) -> dict[str, Any]:
    """Which activities fill most of the video, in order: the right answer names the three that
    take longest, in the order they first appear; the distractors reorder them or swap one."""
    seconds: dict[tuple[str, str], int] = {}
    first: dict[tuple[str, str], int] = {}
    for scene in scenes:
        key = (scene.place, scene.activity)
        seconds[key] = seconds.get(key, 0) + scene.seconds
        first.setdefault(key, scene.start_s)
    top = sorted(seconds, key=lambda k: (-seconds[k], first[k]))[:3]
    while len(top) < 3:  # a video with fewer than three activities repeats its longest
        top.append(top[0])
    right = sorted(top, key=lambda k: first[k])
    absent = [(p, a) for p in sorted(PLACES) for a in PLACES[p]["activities"] if (p, a) not in seconds]
    wrong_place = sorted(set(PLACES) - {right[0][0]})
    candidates = [
        list(reversed(right)),
        [right[1], right[0], right[2]],
        [right[0], right[1], rng.choice(absent)],
        [rng.choice(absent), right[1], right[2]],
        [(rng.choice(wrong_place), right[0][1]), right[1], right[2]],
        [right[0], rng.choice(absent), right[2]],
    ]
    distractors: list[str] = []
    while len(distractors) < 4:
        steps = candidates.pop(0) if candidates else [rng.choice(absent), right[1], rng.choice(absent)]
        text = _summary(steps)
        if text != _summary(right) and text not in distractors:
            distractors.append(text)
    options = [_summary(right), *distractors]
    order = rng.sample(range(5), 5)
    return {
        "question": "Taken as a whole, which activities fill most of this video, and in what order?",
        "options": {LETTERS[slot]: options[i] for slot, i in enumerate(order)},
        "answer": LETTERS[order.index(0)],
    }
