"""The video workload: EgoSchema-shaped multiple-choice questions over generated long videos.

    footage.py   the videos: a folder of frames per task, and its question
    tools.py     the video tools over a folder, with their latencies (also a program)
    policy.py    the simulated policy's seeded rollouts
    workload.py  the Workload: tasks, sandboxes, rollouts, the transcript tokens are counted on
    figures.py   the workload's figures in the report, and the table the command prints
    tinker.py    one task's group through Tinker's own rollout loop (lab/frameworks/video_tinker.py)

footage, tools and policy import only the standard library: the Tinker driver imports them in a
venv of its own.
"""
