"""The CLI's progress (core.progress): live bars on a terminal, the plain lines elsewhere."""

import io
import re

from core.progress import watch


class FakeJob:
    """A job that moves one frame on per `wait`: each frame is (new events, every task's state)."""

    def __init__(self, frames):
        self.frames, self.at, self.events = frames, -1, []

    def wait(self, timeout=None):
        self.at += 1
        self.events += self.frames[self.at][0]
        return self.at == len(self.frames) - 1

    def events_since(self, index):
        return self.events[index:]

    def snapshot(self):
        return {"tasks": self.frames[self.at][1]}


def _task(state, stage="", step=0, of=0):
    return {"state": state, "stage": stage, "step": step, "of": of}


def _job():
    # cpu/float32 runs and succeeds while compare waits; then compare fails at its first step
    return FakeJob(
        [
            (
                [{"task": "cpu/float32", "step": 1, "of": 2, "stage": "load base", "time": 0.0}],
                {"cpu/float32": _task("running", "load base", 1, 2), "compare": _task("queued")},
            ),
            (
                [
                    {"task": "cpu/float32", "step": 2, "of": 2, "stage": "write capture", "time": 0.0},
                    {"task": "compare", "step": 1, "of": 3, "stage": "weights", "time": 0.0},
                ],
                {
                    "cpu/float32": _task("succeeded", "write capture", 2, 2),
                    "compare": _task("failed", "weights", 1, 3),
                },
            ),
        ]
    )


def test_not_a_terminal_gets_a_line_per_event_and_the_tasks_that_did_not_succeed():
    out = io.StringIO()  # not a terminal: plain lines, as in CI logs
    watch(_job(), stream=out, interval=0)
    lines = out.getvalue().splitlines()
    assert [re.sub(r" \(-?\d+\.\d s\)$", "", line) for line in lines] == [
        "cpu/float32                  [##########..........]  1/2  load base",
        "cpu/float32                  [####################]  2/2  write capture",
        "compare                      [######..............]  1/3  weights",
        "compare                      failed",
    ]


def test_a_terminal_gets_a_bar_per_task_that_ends_with_its_state():
    out = io.StringIO()
    watch(_job(), stream=out, interval=0, live=True)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control sequences
    final = text.rstrip().splitlines()[-2:]  # the last frame drawn: one line per task, in order
    assert final[0].split()[0] == "cpu/float32" and "2/2" in final[0] and "succeeded" in final[0]
    assert final[1].split()[0] == "compare" and "1/3" in final[1] and "failed" in final[1]
    assert "[####" not in text  # no plain line among the bars
