"""Checks for tests/multihost/run.sh.

  check.py metrics FILE   every line of a /metrics scrape parses (Prometheus
                          text 0.0.4), and it shows the job the test made:
                          all five members up, a committed switch, server 2's
                          share below a third, bytes through the servers
                          that hold load; exit 1 naming what is missing
  check.py top FILE       the same from `psld top --once --json`
  check.py round FILE     the job's highest round, from a scrape
"""

import json
import math
import re
import sys

SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\[\\"n])*)"(,|$)')


def parse(text):
    """Samples as (name, labels, value); raises ValueError on a bad line."""
    if text and not text.endswith("\n"):
        raise ValueError("the scrape does not end with a newline")
    types = {}
    family = None
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            parts = line.split(" ")
            if len(parts) != 4 or parts[3] not in ("counter", "gauge", "histogram"):
                raise ValueError(f"line {n}: bad TYPE: {line}")
            family = parts[2]
            types[family] = parts[3]
            continue
        if line.startswith("#"):
            raise ValueError(f"line {n}: a comment that is neither HELP nor TYPE: {line}")
        m = SAMPLE.match(line)
        if not m:
            raise ValueError(f"line {n}: not a sample: {line}")
        name, _, body, value = m.groups()
        labels = {}
        rest = body or ""
        while rest:
            lm = LABEL.match(rest)
            if not lm:
                raise ValueError(f"line {n}: bad labels: {line}")
            labels[lm.group(1)] = lm.group(2)
            rest = rest[lm.end():]
        base = name
        if types.get(family) == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                if name == family + suffix:
                    base = family
        if base != family:
            raise ValueError(f"line {n}: {name} outside its family {family}")
        v = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(value)
        samples.append((name, labels, float(value) if v is None else v))
    return samples


def value(samples, name, **want):
    found = [v for (n, labels, v) in samples
             if n == name and all(labels.get(k) == w for k, w in want.items())]
    if len(found) != 1:
        raise KeyError(f"{name} {want}: {len(found)} samples")
    return found[0]


def check_metrics(path):
    samples = parse(open(path).read())
    problems = []
    for role, ranks in (("worker", (0, 1)), ("server", (0, 1, 2))):
        for r in ranks:
            if value(samples, "psld_member_up", role=role, rank=str(r)) != 1:
                problems.append(f"{role} {r} is not up")
    switches = value(samples, "psld_placement_switches_total")
    share2 = value(samples, "psld_server_share", server="2")
    print(f"round {value(samples, 'psld_round'):.0f}, switches {switches:.0f}, "
          f"shares " + ", ".join(
              f"{value(samples, 'psld_server_share', server=str(s)):.3f}" for s in range(3)))
    if switches < 1:
        problems.append("no switch committed yet")
    if share2 >= 1 / 3:
        problems.append(f"server 2 still holds {share2:.3f} of the model")
    for s in range(3):
        share = value(samples, "psld_server_share", server=str(s))
        moved = value(samples, "psld_server_bytes_total", server=str(s), direction="in")
        if share > 0.05 and moved <= 0:
            problems.append(f"server {s} holds {share:.3f} but received nothing")
    if problems:
        print("not yet: " + "; ".join(problems))
        return 1
    return 0


def check_top(path):
    view = json.load(open(path))
    problems = []
    if view["state"] != "running":
        problems.append(f"state {view['state']}")
    if len(view["members"]) != 5 or any(m["state"] != "up" for m in view["members"]):
        problems.append(f"members {view['members']}")
    if len(view["servers"]) != 3:
        problems.append(f"{len(view['servers'])} servers")
    server2 = [s for s in view["servers"] if s["rank"] == 2]
    if not server2 or server2[0]["share"] >= 1 / 3:
        problems.append(f"server 2: {server2}")
    if not view["decisions"] or not view["decisions"][-1]["reason"]:
        problems.append("no balancer decision with a reason")
    if view["epoch"] < 1:
        problems.append(f"epoch {view['epoch']}")
    if problems:
        print("psld top --json: " + "; ".join(problems))
        return 1
    print(f"psld top --json: epoch {view['epoch']}, {len(view['decisions'])} decisions, "
          f"last: {view['decisions'][-1]['reason'][:100]}")
    return 0


def main():
    what, path = sys.argv[1], sys.argv[2]
    try:
        if what == "metrics":
            return check_metrics(path)
        if what == "top":
            return check_top(path)
        if what == "round":
            print(int(value(parse(open(path).read()), "psld_round")))
            return 0
    except (ValueError, KeyError) as e:
        print(f"{what}: {e}")
        return 1
    print(f"unknown check {what}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
