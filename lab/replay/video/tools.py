"""The video tools: deterministic functions of a video folder (footage.py) and their arguments.

Each has a fixed latency standing in for the model or decoder a real one runs (CPU only here: the
tool sleeps it, then computes its answer from the files). Latencies and effects:

    video_info      meta.json, clips/, notes.jsonl            50 ms  read-only
    sample_frames   the frames of a window                    300 ms  read-only
    caption_frames  the frames of a window: long captions     800 ms  read-only, generates text
    retrieve_clip   every frame and the notes: top windows    500 ms  read-only
    extract_clip    the frames of a window -> clips/<name>    400 ms  changes state
    caption_clip    clips/<name>: a long narrative            800 ms  read-only, generates text
    annotate        notes.jsonl += one note                    30 ms  changes state
    answer          question.json: right or wrong              20 ms  read-only

Read-only tools still read state that others change (`caption_clip` reads the clip an
`extract_clip` wrote, `retrieve_clip` and `video_info` the notes), so the state model matters.

The module is also a program: `python -m lab.replay.video.tools NAME ARGS_JSON` runs one tool
in the current folder and prints its result (`render`): the Tinker driver's tools run it inside
their sandbox. It imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .footage import frame_path

Result = dict[str, Any]
# Bump when a tool's answer changes: it is part of the tasks' environment fingerprint.
TOOLS_VERSION = 1
WINDOW_S = 10  # retrieve_clip scores windows of this length
MAX_WINDOW_S = 60  # the longest window a caption or a clip may cover
CAPTION_STRIDE_S = 2  # caption_frames captions a frame every this many seconds
NARRATIVE_STRIDE_S = 5  # caption_clip's moments
_NAME = re.compile(r"[a-z0-9_-]{1,32}")
_STOP = frozenset({"a", "an", "and", "at", "c", "in", "is", "of", "on", "the", "then", "to", "with", "later"})


class ToolArgumentError(ValueError):
    """A call's arguments the tool refuses: answered as {"error": ...}, like any tool would."""


# ---------------------------------------------------------------------------------------------
# Reading and writing the folder


def _json(root: Path, path: str) -> Any:
    return json.loads((root / path).read_text())


def _meta(root: Path) -> dict[str, Any]:
    return _json(root, "meta.json")


def _frames(root: Path, start_s: int, end_s: int) -> list[dict[str, Any]]:
    return [_json(root, frame_path(t)) for t in range(start_s, end_s)]


def _notes(root: Path) -> list[dict[str, Any]]:
    path = root / "notes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _int(args: Mapping[str, Any], key: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ToolArgumentError(f"{key} must be an integer")
    return value


def _str(args: Mapping[str, Any], key: str, limit: int = 200) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ToolArgumentError(f"{key} must be a string of 1 to {limit} characters")
    return value


def _window(root: Path, args: Mapping[str, Any], longest_s: int | None = MAX_WINDOW_S) -> tuple[int, int]:
    start, end = _int(args, "start_s"), _int(args, "end_s")
    duration = _meta(root)["duration_s"]
    if not 0 <= start < end <= duration:
        raise ToolArgumentError(f"the window must lie within 0..{duration} s, start before end")
    if longest_s is not None and end - start > longest_s:
        raise ToolArgumentError(f"a window covers at most {longest_s} s")
    return start, end


# ---------------------------------------------------------------------------------------------
# What the tools say of frames


def clock(seconds: int) -> str:
    return f"{seconds // 60:02d}:{seconds % 60:02d}"


def brightness(frame: Mapping[str, Any]) -> int:
    pixels = bytes.fromhex(frame["thumb"])
    return round(sum(pixels) / len(pixels))


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def _pace(motion: float) -> str:
    return "slowly" if motion < 0.3 else "at a steady pace" if motion < 0.7 else "quickly"


def _light(value: int) -> str:
    return "dim" if value < 110 else "evenly lit" if value < 170 else "bright"


_OPENERS = ("At {t}", "Around {t}", "By {t}", "Just after {t}")


def caption(frame: Mapping[str, Any]) -> str:
    """A captioning model's paragraph about one frame (about 70 tokens)."""
    pick = int(hashlib.sha256(frame["thumb"].encode()).hexdigest()[:8], 16)
    objects = list(frame["objects"])
    light = brightness(frame)
    return (
        f"{_OPENERS[pick % len(_OPENERS)].format(t=clock(frame['t_s']))}, C is {frame['activity']} in the "
        f"{frame['place']}, working with {frame['hands']}. The {_listing(objects)} are in view, and C "
        f"reaches for the {objects[pick % len(objects)]}. The camera looks {frame['gaze']}; the picture is "
        f"{_light(light)} (mean brightness {light}) and C moves {_pace(frame['motion'])}."
    )


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower())) - _STOP


def frame_words(frame: Mapping[str, Any]) -> set[str]:
    return words(" ".join([frame["place"], frame["activity"], *frame["objects"]]))


def retrieve(frames: list[dict[str, Any]], notes: list[dict[str, Any]], query: str, top_k: int) -> list[dict[str, Any]]:
    """The `top_k` windows of WINDOW_S seconds that match `query` best: per frame, the query's
    words it shows; per note over the window, three times the query's words it holds."""
    wanted = words(query)
    scored = []
    for start in range(0, len(frames), WINDOW_S):
        window = frames[start : start + WINDOW_S]
        end = start + len(window)
        score = sum(len(wanted & frame_words(f)) for f in window)
        score += sum(3 * len(wanted & words(n["text"])) for n in notes if n["start_s"] < end and n["end_s"] > start)
        if score:
            middle = window[len(window) // 2]
            scored.append(
                {
                    "start_s": start,
                    "end_s": end,
                    "score": score,
                    "place": middle["place"],
                    "activity": middle["activity"],
                }
            )
    scored.sort(key=lambda w: (-w["score"], w["start_s"]))
    return scored[:top_k]


def _narrative(name: str, frames: list[dict[str, Any]]) -> str:
    """A captioning model's account of a clip: its stretches of one activity, what is seen most,
    then its moments (several hundred tokens)."""
    stretches: list[list[dict[str, Any]]] = []
    for frame in frames:
        if stretches and stretches[-1][-1]["activity"] == frame["activity"]:
            stretches[-1].append(frame)
        else:
            stretches.append([frame])
    parts = [f"Clip '{name}' runs from {clock(frames[0]['t_s'])} to {clock(frames[-1]['t_s'] + 1)}."]
    for stretch in stretches:
        seen = Counter(o for f in stretch for o in f["objects"]).most_common(4)
        hands = Counter(f["hands"] for f in stretch).most_common(1)[0][0]
        motion = sum(f["motion"] for f in stretch) / len(stretch)
        peak = max(stretch, key=lambda f: (f["motion"], -f["t_s"]))
        parts.append(
            f"From {clock(stretch[0]['t_s'])} to {clock(stretch[-1]['t_s'] + 1)} ({len(stretch)} s) C is "
            f"{stretch[0]['activity']} in the {stretch[0]['place']}, mostly with {hands}. Seen most often: "
            + ", ".join(f"the {o} ({n} of {len(stretch)} frames)" for o, n in seen)
            + f". C moves {_pace(motion)} on average, most at {clock(peak['t_s'])}."
        )
    parts.append("Moments:")
    parts.extend(caption(f) for f in frames[::NARRATIVE_STRIDE_S])
    activities = list(dict.fromkeys(f["activity"] for f in frames))
    parts.append(f"Overall, the clip shows C {_listing(activities)}.")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------
# The tools


def video_info(root: Path, args: Mapping[str, Any]) -> Result:
    clips = sorted(p.stem for p in (root / "clips").glob("*.json")) if (root / "clips").is_dir() else []
    return {**_meta(root), "clips": clips, "notes": len(_notes(root))}


def sample_frames(root: Path, args: Mapping[str, Any]) -> Result:
    start, end = _window(root, args, longest_s=None)
    count = _int(args, "count")
    if not 1 <= count <= 32:
        raise ToolArgumentError("count must be 1 to 32")
    step = max(1, (end - start) // count)
    frames = _frames(root, start, end)[::step][:count]
    return {
        "frames": [
            {
                "t_s": f["t_s"],
                "place": f["place"],
                "objects": f["objects"],
                "hands": f["hands"],
                "brightness": brightness(f),
            }
            for f in frames
        ]
    }


def caption_frames(root: Path, args: Mapping[str, Any]) -> Result:
    start, end = _window(root, args)
    frames = _frames(root, start, end)[::CAPTION_STRIDE_S]
    return {"start_s": start, "end_s": end, "captions": [caption(f) for f in frames]}


def retrieve_clip(root: Path, args: Mapping[str, Any]) -> Result:
    query, top_k = _str(args, "query"), _int(args, "top_k")
    if not 1 <= top_k <= 10:
        raise ToolArgumentError("top_k must be 1 to 10")
    frames = _frames(root, 0, _meta(root)["duration_s"])
    return {"query": query, "windows": retrieve(frames, _notes(root), query, top_k)}


def extract_clip(root: Path, args: Mapping[str, Any]) -> Result:
    start, end = _window(root, args)
    name = _str(args, "name", 32)
    if not _NAME.fullmatch(name):
        raise ToolArgumentError("name must be 1 to 32 of a-z, 0-9, _ and -")
    path = root / "clips" / f"{name}.json"
    replaced = path.exists()
    path.parent.mkdir(exist_ok=True)
    frames = _frames(root, start, end)
    path.write_text(json.dumps({"name": name, "start_s": start, "end_s": end, "frames": frames}, sort_keys=True))
    return {"clip": name, "start_s": start, "end_s": end, "frames": len(frames), "replaced": replaced}


def caption_clip(root: Path, args: Mapping[str, Any]) -> Result:
    name = _str(args, "name", 32)
    path = root / "clips" / f"{name}.json"
    if not _NAME.fullmatch(name) or not path.is_file():
        return {"error": f"no clip named {name!r}: extract it first"}
    clip = json.loads(path.read_text())
    return {"clip": name, "narrative": _narrative(name, clip["frames"])}


def annotate(root: Path, args: Mapping[str, Any]) -> Result:
    start, end = _window(root, args)
    note = {"start_s": start, "end_s": end, "text": _str(args, "text")}
    with (root / "notes.jsonl").open("a") as notes:
        notes.write(json.dumps(note, sort_keys=True) + "\n")
    return {"notes": len(_notes(root)), "added": note}


def answer(root: Path, args: Mapping[str, Any]) -> Result:
    option = args.get("option")
    question = _json(root, "question.json")
    if option not in question["options"]:
        raise ToolArgumentError(f"option must be one of {', '.join(sorted(question['options']))}")
    return {"option": option, "correct": option == question["answer"]}


@dataclass(frozen=True)
class VideoTool:
    name: str
    run: Callable[[Path, Mapping[str, Any]], Result]
    latency_ms: float
    read_only: bool
    generates_text: bool  # its answer is a captioning model's output: a hit spares generating it
    description: str
    parameters: dict[str, Any]  # JSON Schema properties; all required


_WINDOW = {"start_s": {"type": "integer"}, "end_s": {"type": "integer"}}
TOOLS: dict[str, VideoTool] = {
    tool.name: tool
    for tool in (
        VideoTool(video_info.__name__, video_info, 50, True, False, "The video's length, clips and notes.", {}),
        VideoTool(
            sample_frames.__name__,
            sample_frames,
            300,
            True,
            False,
            "Sample `count` frames (1 to 32) evenly over a window of any length: place, objects, hands, brightness.",
            {**_WINDOW, "count": {"type": "integer"}},
        ),
        VideoTool(
            caption_frames.__name__,
            caption_frames,
            800,
            True,
            True,
            f"Caption a frame every {CAPTION_STRIDE_S} s of a window (at most {MAX_WINDOW_S} s).",
            dict(_WINDOW),
        ),
        VideoTool(
            retrieve_clip.__name__,
            retrieve_clip,
            500,
            True,
            False,
            f"The {WINDOW_S} s windows that match a query best, notes included.",
            {"query": {"type": "string"}, "top_k": {"type": "integer"}},
        ),
        VideoTool(
            extract_clip.__name__,
            extract_clip,
            400,
            False,
            False,
            "Cut a window into a named clip (clips/<name>), replacing one of that name.",
            {**_WINDOW, "name": {"type": "string"}},
        ),
        VideoTool(
            caption_clip.__name__,
            caption_clip,
            800,
            True,
            True,
            "Narrate an extracted clip: its stretches of activity and its moments.",
            {"name": {"type": "string"}},
        ),
        VideoTool(
            annotate.__name__,
            annotate,
            30,
            False,
            False,
            "Keep a note about a window; retrieval weighs notes.",
            {**_WINDOW, "text": {"type": "string"}},
        ),
        VideoTool(
            answer.__name__,
            answer,
            20,
            True,
            False,
            "Give the final answer: one option letter.",
            {"option": {"type": "string", "enum": ["A", "B", "C", "D", "E"]}},
        ),
    )
}


def run_tool(root: Path, call: Mapping[str, Any], latency_scale: float = 1.0) -> Result:
    """The call's answer in the video folder `root`, after the tool's latency (times the scale)."""
    tool = TOOLS.get(call["tool"])
    if tool is None:
        return {"error": f"unknown tool {call['tool']!r}"}
    time.sleep(tool.latency_ms * latency_scale / 1000)
    try:
        return tool.run(root, call["args"])
    except ToolArgumentError as exc:
        return {"error": str(exc)}


def render(result: Result) -> str:
    """The answer as the policy reads it (the program's output, the tool message's content)."""
    return json.dumps(result)


def tokens(result: Result) -> int:
    """The answer's length in tokens by the usual rule for English text: a token per 4 characters
    of `render(result)`, rounded up."""
    return math.ceil(len(render(result)) / 4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one video tool in the current folder.")
    parser.add_argument("tool", choices=sorted(TOOLS))
    parser.add_argument("args", help="the call's arguments as a JSON object")
    parser.add_argument("--latency-scale", type=float, default=1.0)
    options = parser.parse_args(argv)
    result = run_tool(Path.cwd(), {"tool": options.tool, "args": json.loads(options.args)}, options.latency_scale)
    sys.stdout.write(render(result))


if __name__ == "__main__":
    main()
