"""Realistic prompts for the one-user workloads of issue 48 (bench/runtime_bench.py, and the
greedy-identity test of speculative decoding): a code edit (a 60-120-line file to give back with
a small change), a RAG answer (a ~1,500-token context the answer quotes) and a summary. The
distinct-chat prompts stay in runtime_bench.PROMPTS. Every text is fixed: runs compare."""

from __future__ import annotations

# --- code edit ----------------------------------------------------------------------------

_INVENTORY = '''"""Stock levels of the spare parts kept at each edge site."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path

REORDER_DAYS = 14
SAFETY_FACTOR = 1.5


@dataclasses.dataclass
class Part:
    sku: str
    name: str
    unit_cost: float
    on_hand: int = 0
    reserved: int = 0

    @property
    def available(self) -> int:
        return max(0, self.on_hand - self.reserved)


@dataclasses.dataclass
class Site:
    name: str
    parts: dict[str, Part] = dataclasses.field(default_factory=dict)
    usage: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def add(self, part: Part) -> None:
        if part.sku in self.parts:
            raise ValueError(f"{part.sku} is already stocked at {self.name}")
        self.parts[part.sku] = part

    def record_use(self, sku: str, count: int) -> None:
        part = self.parts[sku]
        if count > part.available:
            raise ValueError(f"only {part.available} of {sku} available at {self.name}")
        part.on_hand -= count
        self.usage.setdefault(sku, []).append(count)

    def daily_use(self, sku: str) -> float:
        history = self.usage.get(sku, [])
        if not history:
            return 0.0
        return sum(history) / len(history)

    def reorder_point(self, sku: str) -> int:
        return round(self.daily_use(sku) * REORDER_DAYS * SAFETY_FACTOR)

    def to_reorder(self) -> list[str]:
        return sorted(
            sku for sku, part in self.parts.items() if part.available <= self.reorder_point(sku)
        )

    def value(self) -> float:
        return sum(p.on_hand * p.unit_cost for p in self.parts.values())


def load(path: Path) -> list[Site]:
    raw = json.loads(path.read_text())
    sites = []
    for entry in raw["sites"]:
        site = Site(entry["name"])
        for item in entry["parts"]:
            cost, count = float(item["unit_cost"]), int(item["on_hand"])
            site.add(Part(item["sku"], item["name"], cost, count))
        sites.append(site)
    return sites


def report(sites: list[Site], today: dt.date) -> str:
    lines = [f"Stock report for {today.isoformat()}"]
    for site in sites:
        lines.append(f"{site.name}: value {site.value():.2f}")
        for sku in site.to_reorder():
            part = site.parts[sku]
            lines.append(f"  reorder {sku} ({part.name}): {part.available} left")
    return "\\n".join(lines)
'''

_SCHEDULER = """package schedule

import (
\t"errors"
\t"sort"
\t"time"
)

// Visit is one technician visit to a site.
type Visit struct {
\tSite       string
\tTechnician string
\tStart      time.Time
\tDuration   time.Duration
\tUrgent     bool
}

// End is when the visit is over.
func (v Visit) End() time.Time {
\treturn v.Start.Add(v.Duration)
}

// Plan holds the visits of one week.
type Plan struct {
\tvisits []Visit
\tmaxPerDay int
}

var ErrOverlap = errors.New("visit overlaps another visit of the same technician")
var ErrFull = errors.New("the technician already has the most visits allowed that day")

// NewPlan makes an empty plan allowing maxPerDay visits per technician per day.
func NewPlan(maxPerDay int) *Plan {
\treturn &Plan{maxPerDay: maxPerDay}
}

func sameDay(a, b time.Time) bool {
\tya, ma, da := a.Date()
\tyb, mb, db := b.Date()
\treturn ya == yb && ma == mb && da == db
}

// Add puts a visit in the plan, refusing overlaps and full days.
func (p *Plan) Add(v Visit) error {
\tcount := 0
\tfor _, other := range p.visits {
\t\tif other.Technician != v.Technician {
\t\t\tcontinue
\t\t}
\t\tif v.Start.Before(other.End()) && other.Start.Before(v.End()) {
\t\t\treturn ErrOverlap
\t\t}
\t\tif sameDay(other.Start, v.Start) {
\t\t\tcount++
\t\t}
\t}
\tif count >= p.maxPerDay {
\t\treturn ErrFull
\t}
\tp.visits = append(p.visits, v)
\treturn nil
}

// For returns a technician's visits in time order.
func (p *Plan) For(technician string) []Visit {
\tvar out []Visit
\tfor _, v := range p.visits {
\t\tif v.Technician == technician {
\t\t\tout = append(out, v)
\t\t}
\t}
\tsort.Slice(out, func(i, j int) bool { return out[i].Start.Before(out[j].Start) })
\treturn out
}

// Urgent returns the urgent visits, earliest first.
func (p *Plan) Urgent() []Visit {
\tvar out []Visit
\tfor _, v := range p.visits {
\t\tif v.Urgent {
\t\t\tout = append(out, v)
\t\t}
\t}
\tsort.Slice(out, func(i, j int) bool { return out[i].Start.Before(out[j].Start) })
\treturn out
}
"""

_CODE_EDITS = [
    ("python", _INVENTORY, "Rename the constant SAFETY_FACTOR to SAFETY_MARGIN everywhere."),
    ("python", _INVENTORY, "Make REORDER_DAYS 21 instead of 14."),
    ("python", _INVENTORY, "Add a docstring to the method value() saying what it returns."),
    ("python", _INVENTORY, "Make report() print the value with no decimals."),
    ("go", _SCHEDULER, "Rename the method For to ForTechnician."),
    ("go", _SCHEDULER, "Change the error text of ErrFull to say 'day is full'."),
    ("go", _SCHEDULER, "Make NewPlan refuse a maxPerDay below 1 by using 1 instead."),
    ("go", _SCHEDULER, "Add a comment above sameDay explaining what it compares."),
]

CODE_EDIT = [
    f"Here is a file:\n\n```{lang}\n{code}```\n\nTask: {task} Reply with the whole updated file "
    f"and nothing else.\n\n```{lang}\n"
    for lang, code, task in _CODE_EDITS
]

# --- RAG answer ---------------------------------------------------------------------------

_MANUAL = [
    (
        "Gateways",
        "Every site has one LTE gateway that forwards the readings of the devices around it "
        "every five minutes. A gateway keeps up to seventy-two hours of readings in its own "
        "flash memory when the link is down, and sends the backlog oldest first once the link "
        "returns. The green light means the link is up; a blinking amber light means the "
        "gateway is sending its backlog; a steady red light means the modem could not register "
        "with the network for more than ten minutes. A gateway that misses three reports in a "
        "row is marked offline in the dashboard. Restarting a gateway from the dashboard is "
        "safe: it keeps its backlog. Replacing its SIM card requires a visit and the site's "
        "access code, which the on-call engineer gives out by phone only.",
    ),
    (
        "Water pumps",
        "Pumps report their flow in litres per minute every minute, and their motor "
        "temperature every ten minutes. A flow of zero while the pump is switched on usually "
        "means a dry well or a blocked intake: the pump stops itself after three minutes at "
        "zero flow to protect the motor, and tries again after thirty minutes. A motor "
        "temperature above eighty-five degrees Celsius stops the pump until it cools below "
        "sixty. Pumps at Lake Farm share one solar inverter, so on cloudy days they run one at "
        "a time; this is expected and is not a fault. A pump that restarts more than six times "
        "in an hour should be switched off from the dashboard and reported.",
    ),
    (
        "Cameras",
        "Cameras upload one frame every ten minutes and a short clip when their motion sensor "
        "fires. Clips are kept on the camera's card for seven days. A camera whose frames are "
        "all black at night has lost its infrared lamp; during the day it points at the sky "
        "after a storm has moved its mount. Cleaning the lens is part of every visit. A camera "
        "that uploads nothing for an hour while its gateway is online needs a power cycle, "
        "which the technician does at the site's junction box, not from the dashboard.",
    ),
    (
        "Batteries and inverters",
        "Battery banks should stay between twenty and ninety percent charge. Below twenty "
        "percent the inverter sheds the cameras first, then the pumps, and keeps the gateway "
        "running until the bank reaches ten percent. A bank that never charges above sixty "
        "percent on a sunny day has a failing cell or dirty panels: the technician cleans the "
        "panels first and measures each cell only if that does not help. Inverter firmware "
        "updates happen on Tuesday nights and restart the inverter, which restarts every "
        "device powered by it; a restart on a Tuesday night is therefore not a fault.",
    ),
    (
        "Weather stations",
        "Weather stations measure temperature, humidity, wind and rain every minute and send "
        "ten-minute averages. A rain gauge that reports rain on a dry day is usually blocked by "
        "leaves and gives false tips when the wind moves the debris. A wind reading stuck at "
        "zero for a day means the anemometer bearing has seized; it is replaced, never oiled. "
        "Temperature readings that jump by more than ten degrees in ten minutes point to a "
        "loose sensor cable, which is checked at the next visit unless two stations show it.",
    ),
    (
        "Visits and escalation",
        "Technicians visit North Ridge and Lake Farm on Mondays and the other sites on "
        "Thursdays. An extra visit is booked only for a whole site offline for more than an "
        "hour, a pump that keeps restarting, or a battery bank below fifteen percent. The "
        "on-call engineer is called only when a whole site is offline for more than an hour, "
        "or when two sites are offline at the same time. Every visit ends with a short note in "
        "the dashboard saying what was found, what was changed, and which parts were used, so "
        "that the stock of spare parts at each site stays right.",
    ),
]
_CONTEXT = "\n\n".join(f"## {title}\n\n{text}" for title, text in _MANUAL * 2)
_RAG_QUESTIONS = [
    "A gateway shows a blinking amber light. What does that mean?",
    "The pump at Lake Farm stopped by itself after three minutes. Why might that be?",
    "The camera at Harbour shows black frames at night. What is wrong?",
    "The battery bank never charges above sixty percent on sunny days. What should be done?",
    "The rain gauge reports rain on a dry day. What is the likely cause?",
    "When should the on-call engineer be called?",
    "An inverter restarted on Tuesday night. Is that a fault?",
    "A wind reading has been stuck at zero all day. What is the fix?",
]
RAG = [
    "Answer the question using only the maintenance manual below, and quote the sentences "
    f"you rely on.\n\n# Maintenance manual\n\n{_CONTEXT}\n\n# Question\n\n{question}\n\n# Answer "
    "(with quotes)\n\n"
    for question in _RAG_QUESTIONS
]

# --- summary ------------------------------------------------------------------------------

SUMMARY = [
    f"Summarize the following section of the maintenance manual in three sentences, reusing "
    f"its own words where you can.\n\n## {title}\n\n{text}\n\n{title2}\n\n{text2}\n\n"
    "Summary:\n\n"
    for (title, text), (title2, text2) in zip(_MANUAL, _MANUAL[1:] + _MANUAL[:1], strict=True)
]

WORKLOAD_PROMPTS = {"code-edit": CODE_EDIT, "rag": RAG, "summary": SUMMARY}
