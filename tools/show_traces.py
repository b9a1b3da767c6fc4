"""One self-contained HTML page from the traces of one or more runs (OUT/traces.jsonl, written by
--trace-every; the record format is docs/traces.md), side by side:

    python tools/show_traces.py runs/grpo runs/gspo                # -> runs/grpo/traces.html
    python tools/show_traces.py runs/grpo runs/gspo --out page.html --screenshot docs/traces.png --step 10

Each completion is a row of tokens, coloured by the quantity chosen at the top (advantage, ratio,
clipped, entropy, KL to the reference, the token's own log-ratio) on one scale shared by every run
and step (or per run and step), keyed in the quantity's own values with the clip bounds marked;
hovering or tapping a token shows its numbers; the step selector moves through training, and each
step has a summary (groups with signal, clip fraction). The page opens on the ratio (as the
docs/traces.md's picture shows it) at the first step where a traced group has signal: --quantity and
--step choose others. Prompt tokens are grey and outlined, padding dotted, the EOS token marked;
on a screen under 800 px the runs stack. The page holds its data and its one small script
inline: no network, no external file. --screenshot needs selenium and Debian's chromium and
chromium-driver (--width under 800: a phone's touch screen).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script
from cli import ArgumentParser  # noqa: E402  (one-line errors, exit status 2)

from common import die  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's chromium, chromium-driver


def load_run(directory: Path) -> dict:
    """A run's traces and the few settings the page prints beside them."""
    path = directory / "traces.jsonl"
    if not path.is_file():
        die(f"{path} does not exist (run the script with --trace-every, or its default)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary_path = directory / "summary.json"
    args = json.loads(summary_path.read_text()).get("args", {}) if summary_path.is_file() else {}
    algo = records[0]["algo"] if records else "?"
    settings = {k: args[k] for k in ("seed", "eps_low", "eps_high", "variant", "minibatches", "epochs") if k in args}
    # the step's clip fraction over the whole batch (GSPO's sequence variant: clip_frac_seqs), for the summary
    metrics_path, clip_frac, clip_key = directory / "metrics.jsonl", {}, "clip_frac"
    for line in metrics_path.read_text().splitlines() if metrics_path.is_file() else []:
        row = json.loads(line)
        clip_key = "clip_frac_seqs" if "clip_frac_seqs" in row else "clip_frac"
        if clip_key in row:
            clip_frac[str(row["step"])] = row[clip_key]
    return {"label": f"{algo}  ({directory.name})", "algo": algo, "settings": settings, "records": records,
            "clip_frac": clip_frac, "clip_key": clip_key}  # fmt: skip


STYLE = """
body { font: 13px/1.45 system-ui, sans-serif; margin: 12px; color: #222; }
header { position: sticky; top: 0; background: #fff; padding: 6px 0; border-bottom: 1px solid #ccc; z-index: 2; }
header label { margin-right: 14px; white-space: nowrap; }
#legend { color: #555; }
#why { color: #666; font-size: 12px; margin: 4px 0 0; }
.runs { display: grid; gap: 18px; margin-top: 10px; grid-template-columns: repeat(var(--columns, 1), minmax(0, 1fr)); }
@media (max-width: 800px) { .runs { grid-template-columns: minmax(0, 1fr); } header { position: static; } }
.run h2 { font-size: 15px; margin: 4px 0; overflow-wrap: anywhere; }
.run .settings, .summary { color: #666; font-size: 12px; }
.summary { margin: 4px 0; }
.key { margin: 6px 0; font-size: 11px; color: #444; }
.key .bar { position: relative; height: 12px; width: min(320px, 100%); border: 1px solid #aaa; }
.key .mark { position: absolute; top: -3px; bottom: -3px; width: 2px; margin-left: -1px; background: #000; }
.key .ticks { position: relative; height: 14px; width: min(320px, 100%); }
.key .ticks span { position: absolute; transform: translateX(-50%); white-space: nowrap; }
.key .ticks span:first-child { transform: none; }
.key .ticks span:last-child { transform: translateX(-100%); }
.key .swatch { display: inline-block; width: 12px; height: 12px; vertical-align: middle; border: 1px solid #aaa; }
.group { margin: 10px 0 14px; padding-top: 4px; border-top: 1px solid #eee; }
.line { margin: 2px 0; font-family: ui-monospace, monospace; }
.line .tok, .line .prompt, .line .pad { display: inline-block; white-space: pre; min-width: 9px; padding: 1px 2px;
  margin: 0 1px; border-radius: 2px; }
.prompt { color: #777; background: #f3f3f3; outline: 1px solid #ddd; }
.pad { color: #bbb; border: 1px dotted #bbb; }
.tok { cursor: pointer; outline: 1px solid #e4e4e4; }
.tok.eos { font-weight: bold; border-bottom: 2px solid #333; }
.tok.null { background: repeating-linear-gradient(45deg, #eee, #eee 3px, #fff 3px, #fff 6px); color: #888; }
.tok.chosen { outline: 2px solid #000; }
.note { font-family: system-ui, sans-serif; color: #666; font-size: 12px; margin-left: 8px; }
.note.signal { color: #2a7a2a; }
.note.on-policy { color: #555; font-style: italic; }
#tip { position: fixed; display: none; background: #fffff0; border: 1px solid #999; padding: 6px 8px; z-index: 3;
       font: 12px ui-monospace, monospace; white-space: pre-wrap; overflow-wrap: anywhere; pointer-events: none;
       max-width: calc(100vw - 10px); box-sizing: border-box; }
"""

# What a token can be coloured by: the page's QUANTITIES, in its order (--quantity)
QUANTITIES = ("advantage", "ratio", "clipped", "entropy", "kl", "log_ratio")

# The page's one script: renders the chosen step of every run from the inline JSON.
SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('traces').textContent);
const $ = (id) => document.getElementById(id);
const QUANTITIES = {
  advantage: 'advantage (per token for PPO)',
  ratio: 'ratio the loss used (GSPO: its sequence ratio)',
  clipped: 'clipped by the loss',
  entropy: 'entropy of pi_old (sampling)',
  kl: 'KL to the reference: log pi_old - log ref',
  log_ratio: "the token's own log(pi / pi_old)",
};
// What each colour means, in the quantity's own values (the ratio is coloured by its log, keyed in ratios)
const LEGENDS = {
  advantage: 'blue below 0, red above',
  ratio: 'blue below 1, red above (coloured by log ratio); black marks: the clip bounds',
  clipped: 'orange clipped, green not',
  entropy: 'white 0 to purple high (entropy is never negative)',
  kl: 'blue below 0, red above',
  log_ratio: 'blue below 0, red above',
};
const ALL = DATA.runs.flatMap((run) => run.records.flatMap((r) => r.completions));
const HAS_REFERENCE = ALL.some((c) => c.ref_logp);
const SEVERAL_UPDATES = ALL.some((c) => c.updates && c.updates.length > 1);
// rounded for reading: 4 significant digits (a ratio 6, so that GSPO's 1 + 3e-4 stays visible), no trailing zeros
function num(v, digits = 4) {
  if (v === null || v === undefined) return 'none';
  if (typeof v === 'boolean') return v ? 'yes' : 'no';
  return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(digits)));
}
const RATIO_DIGITS = 6;
function entryOf(c, which) {
  if (!c.updates) return null;
  return which === 'first' ? c.updates[0] : c.updates[c.updates.length - 1];
}
function onPolicy(u) {  // as the script marked the update (traces written before it kept `on_policy`: update 0)
  return u.on_policy !== undefined ? u.on_policy : u.update === 0;
}
function hasSignal(r) {  // some advantage nonzero (records written before the trace kept `signal`)
  if (r.signal !== undefined) return r.signal;
  return r.completions.some((c) => [].concat(c.advantage).some((a) => a !== 0));
}
function valueOf(c, t, q, which) {
  const u = entryOf(c, which);
  if (q === 'advantage') return Array.isArray(c.advantage) ? c.advantage[t] : c.advantage;
  if (q === 'entropy') return c.entropy ? c.entropy[t] : null;
  if (q === 'kl') return c.ref_logp && c.old_logp ? c.old_logp[t] - c.ref_logp[t] : null;
  if (!u) return null;
  if (q === 'ratio') return u.ratio ? Math.log(u.ratio[t]) : null;
  if (q === 'clipped') return u.clipped ? (u.clipped[t] ? 1 : 0) : null;
  if (q === 'log_ratio') return u.logp[t] - c.old_logp[t];
  return null;
}
function colour(v, q, scale) {
  if (q === 'clipped') return v ? 'rgb(255,140,0)' : 'rgb(225,240,225)';
  // the colour's strength is |v| / scale alone: white is 0 (a ratio of 1), full colour the scale's end
  const x = Math.max(-1, Math.min(1, v / (scale || 1)));
  if (q === 'entropy') return `rgba(120,60,200,${(0.85 * Math.abs(x)).toFixed(3)})`;
  return x >= 0 ? `rgba(220,50,40,${(0.85 * x).toFixed(3)})` : `rgba(40,90,220,${(-0.85 * x).toFixed(3)})`;
}
// the largest |value| over `records`: the colour scale's end
function scaleOf(records, q, which) {
  let scale = 0;
  for (const r of records) for (const c of r.completions) for (let t = 0; t < c.ids.length; t++) {
    const v = valueOf(c, t, q, which);
    if (v !== null && isFinite(v)) scale = Math.max(scale, Math.abs(v));
  }
  return scale;
}
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function span(text, cls) { return el('span', cls, text); }
// the key under a run's name: the colour bar, its values at both ends and the middle, the clip bounds
function key(q, scale, clipRange) {
  const box = el('div', 'key');
  if (q === 'clipped') {
    for (const [v, text] of [[1, 'clipped'], [0, 'not clipped']]) {
      const s = span('', 'swatch'); s.style.background = colour(v, q, 1);
      box.append(s, span(` ${text}  `));
    }
    return box;
  }
  const lo = q === 'entropy' ? 0 : -scale;
  const stops = [];
  for (let i = 0; i <= 10; i++) stops.push(colour(lo + (scale - lo) * i / 10, q, scale));
  const bar = el('div', 'bar'); bar.style.background = `linear-gradient(to right, ${stops.join(', ')})`;
  // the ratio keyed in ratios, not log ratios, with the digits that tell its ends from 1
  const digits = Math.max(4, Math.ceil(-Math.log10(scale || 1)) + 2);
  const shown = (x) => (q === 'ratio' ? num(Math.exp(x), digits) : num(x));
  const ticks = el('div', 'ticks');
  for (const x of [lo, (lo + scale) / 2, scale]) {
    const s = span(shown(x)); s.style.left = `${100 * (x - lo) / (scale - lo || 1)}%`; ticks.appendChild(s);
  }
  box.append(el('div', null, q === 'ratio' ? 'ratio' : QUANTITIES[q].split(' (')[0]), bar, ticks);
  if (q === 'ratio' && clipRange) {
    for (const bound of clipRange) {
      const x = Math.max(-1, Math.min(1, Math.log(bound) / (scale || 1)));
      const m = el('div', 'mark'); m.style.left = `${50 + 50 * x}%`; m.title = `clip bound ${num(bound, RATIO_DIGITS)}`;
      bar.appendChild(m);
    }
    const beyond = scale < Math.max(Math.log(clipRange[1]), -Math.log(clipRange[0]));
    const [low, high] = clipRange.map((bound) => num(bound, RATIO_DIGITS));
    box.appendChild(el('div', 'clip', `clip bounds ${low} and ${high}` +
                       (beyond ? ' (beyond the colour scale: no ratio reached them)' : '')));
  }
  return box;
}
function summary(run, records, which) {
  if (!records.length) return span('no trace at this step', 'summary');
  const withSignal = records.filter(hasSignal).length;
  const parts = [`${withSignal} of ${records.length} traced groups have signal (rewards not all equal` +
                 (run.algo === 'ppo' ? '; PPO: a nonzero advantage)' : ')')];
  const r0 = records[0];
  if (r0.groups_in_step !== undefined) parts.push(`${r0.groups_with_signal} of ${r0.groups_in_step} in the rollout`);
  if (!withSignal) parts.push('no group had signal: nothing to learn from at this step');
  let clipped = 0, tokens = 0;
  for (const r of records) for (const c of r.completions) {
    const u = entryOf(c, which);
    if (u && u.clipped) { clipped += u.clipped.filter(Boolean).length; tokens += u.clipped.length; }
  }
  const step = run.clip_frac[String(r0.step)];
  if (step !== undefined) parts.push(`${run.clip_key} ${num(step)} (the step's)`);
  if (tokens) parts.push(`traced tokens clipped ${clipped} of ${tokens}`);
  return el('div', 'summary', parts.join('; '));
}
function tipText(c, t) {
  const lines = [`token ${JSON.stringify(c.tokens[t])}  id ${c.ids[t]}  position ${t}  row ${c.row}`];
  const parts = Object.entries(c.rewards || {}).map(([k, v]) => `${k} ${num(v)}`);
  lines.push(`reward ${num(c.reward)}` + (parts.length ? `  (${parts.join(', ')})` : ''));
  lines.push(`advantage ${num(Array.isArray(c.advantage) ? c.advantage[t] : c.advantage)}`);
  for (const k of ['old_logp', 'mu', 'ref_logp', 'entropy', 'value', 'token_reward'])
    if (c[k]) lines.push(`${k} ${num(c[k][t])}`);
  if (!c.updates) lines.push('no update forwarded this row (advantage 0)');
  else for (const u of c.updates) {
    const fields = [`logp ${num(u.logp[t])}`];
    if (u.ratio) fields.push(`ratio ${num(u.ratio[t], RATIO_DIGITS)}`);
    if (u.clipped) fields.push(`clipped ${num(u.clipped[t])}`);
    lines.push(`update ${u.update}${onPolicy(u) ? ' (on-policy)' : ''}: ${fields.join('  ')}`);
  }
  return lines.join('\n');
}
// the tooltip beside (x, y), moved to stay inside the window
function showTip(text, x, y) {
  const tip = $('tip');
  tip.textContent = text; tip.style.display = 'block';
  tip.style.left = '0px'; tip.style.top = '0px';
  const w = tip.offsetWidth, h = tip.offsetHeight, margin = 4;
  let left = x + 12, top = y + 14;
  if (left + w > innerWidth - margin) left = Math.max(margin, innerWidth - margin - w);
  if (top + h > innerHeight - margin) top = Math.max(margin, y - 10 - h);
  tip.style.left = left + 'px'; tip.style.top = top + 'px';
}
function hideTip() {
  $('tip').style.display = 'none';
  for (const s of document.querySelectorAll('.tok.chosen')) s.classList.remove('chosen');
}
function render() {
  const step = Number($('step').value), q = $('quantity').value, which = $('update').value;
  const shared = $('scale').value === 'shared';
  hideTip();
  $('legend').textContent = `${QUANTITIES[q]}: ${LEGENDS[q]}; striped: no value. Hover or tap a token for its numbers.`;
  const root = $('runs');
  root.replaceChildren();
  root.style.setProperty('--columns', DATA.runs.length);
  const everything = DATA.runs.flatMap((run) => run.records);
  const sharedScale = scaleOf(everything, q, which);
  for (const run of DATA.runs) {
    const col = el('div', 'run');
    col.append(el('h2', null, run.label),
               span(Object.entries(run.settings).map(([k, v]) => `${k} ${v}`).join(', '), 'settings'));
    const records = run.records.filter((r) => r.step === step);
    const scale = shared ? sharedScale : scaleOf(records, q, which);
    const clipRange = records.length ? records[0].clip_range : null;
    col.append(key(q, scale, clipRange), summary(run, records, which));
    if (q === 'kl' && !run.records.some((r) => r.completions.some((c) => c.ref_logp)))
      col.appendChild(el('div', 'summary', 'no reference model in this run: no KL'));
    for (const r of records) {
      const g = el('div', 'group');
      const p = el('div', 'line');
      for (let i = 0; i < r.prompt.pad; i++) p.appendChild(span(' ', 'pad'));
      for (const t of r.prompt.tokens) p.appendChild(span(t, 'prompt'));
      p.appendChild(span(`group ${r.group}  answer ${r.answer === null ? 'none' : r.answer}`, 'note'));
      const signal = hasSignal(r);
      p.appendChild(span(signal ? 'signal' : 'no signal: rewards all equal', 'note' + (signal ? ' signal' : '')));
      g.appendChild(p);
      for (const c of r.completions) {
        const line = el('div', 'line');
        c.tokens.forEach((text, t) => {
          const v = valueOf(c, t, q, which);
          const eos = c.eos && t === c.tokens.length - 1;
          const s = span(text, 'tok' + (eos ? ' eos' : '') + (v === null ? ' null' : ''));
          if (v !== null) s.style.background = colour(v, q, scale);
          s.dataset.row = c.row; s.dataset.t = t;
          const pinned = () => document.querySelector('.tok.chosen');
          s.addEventListener('mouseenter', (e) => { if (!pinned()) showTip(tipText(c, t), e.clientX, e.clientY); });
          s.addEventListener('mouseleave', () => { if (!pinned()) hideTip(); });
          s.addEventListener('click', (e) => {  // a tap (or click) pins the numbers until the next tap
            e.stopPropagation();
            const again = s.classList.contains('chosen');
            hideTip();
            if (again) return;
            s.classList.add('chosen');
            const box = s.getBoundingClientRect();
            showTip(tipText(c, t), box.left, box.bottom - 10);
          });
          line.appendChild(s);
        });
        for (let i = 0; i < c.pad; i++) line.appendChild(span(' ', 'pad'));
        const adv = Array.isArray(c.advantage) ? 'per token' : num(c.advantage);
        const notes = [`reward ${num(c.reward)}`, `A ${adv}`];
        if (!c.eos) notes.push('truncated');
        if (!c.updates) notes.push('not forwarded: no update');
        line.appendChild(span(notes.join('  '), 'note'));
        const u = entryOf(c, which);
        if (u && onPolicy(u) && q !== 'advantage' && q !== 'entropy' && q !== 'kl') {
          // --old-logp rollout: pi_old is the sampler's log-prob, so even update 0's ratio is not exactly 1
          const one = u.ratio && u.ratio.every((x) => x === 1);
          line.appendChild(span(`on-policy (update ${u.update}${one ? ': ratio 1' : ''})`, 'note on-policy'));
        }
        g.appendChild(line);
      }
      col.appendChild(g);
    }
    root.appendChild(col);
  }
}
const steps = [...new Set(DATA.runs.flatMap((r) => r.records.map((x) => x.step)))].sort((a, b) => a - b);
for (const s of steps) $('step').add(new Option(String(s), String(s)));
for (const [k, v] of Object.entries(QUANTITIES)) if (k !== 'kl' || HAS_REFERENCE) $('quantity').add(new Option(k, k));
$('quantity').value = DATA.quantity;
// opens at --step, else at the first step where some traced group has signal, else the first
const withSignal = steps.filter((s) => DATA.runs.some((run) => run.records.some((r) => r.step === s && hasSignal(r))));
const opening = DATA.step !== null && steps.includes(DATA.step) ? DATA.step : (withSignal[0] ?? steps[0]);
if (opening !== undefined) $('step').value = String(opening);
if (!SEVERAL_UPDATES) $('update-control').hidden = true;  // every row has one update: first = last
for (const id of ['step', 'quantity', 'update', 'scale']) $(id).addEventListener('change', render);
document.addEventListener('click', hideTip);
render();
"""

WHY = (
    "On-policy: a row whose update is the step's first (update 0) ran before any optimizer step, so pi = pi_old"
    " and its ratio is exactly 1 (white); later updates are off-policy. A group has signal when its rewards are"
    " not all equal (PPO: some advantage is nonzero); the trace prefers such groups."
)


def page(runs: list[dict], step: int | None = None, quantity: str = "ratio") -> str:
    """The HTML page; `step`: the step it opens at (default: the first where a traced group has signal);
    `quantity`: the colour it opens on."""
    data = json.dumps({"runs": runs, "step": step, "quantity": quantity})
    # inside <script>: no "</script>" can end it early, and no "http://" appears even in a token's text
    data = data.replace("<", "\\u003c").replace("/", "\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>traces: {" | ".join(r["label"] for r in runs)}</title>
<style>{STYLE}</style></head>
<body>
<header>
<label>step <select id="step"></select></label>
<label>colour <select id="quantity"></select></label>
<label id="update-control">update <select id="update"><option value="last">last</option>
<option value="first">first</option></select></label>
<label>scale <select id="scale"><option value="shared">shared by all runs and steps</option>
<option value="view">per run and step</option></select></label>
<div id="legend"></div>
</header>
<p id="why">{WHY}</p>
<div id="runs" class="runs"></div>
<div id="tip"></div>
<script type="application/json" id="traces">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def headless_chromium(width: int = 1500, height: int = 950, phone: bool = False):
    """Selenium's Chrome driver on Debian's chromium, headless, with the network off (the page must
    need none). `phone`: a touch screen of width x height CSS pixels that honours the page's viewport
    tag, as a phone's browser does. Raises if selenium, chromium or chromium-driver is missing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}",
                 "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # a path: no driver download
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.emulateNetworkConditions",
        {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0},
    )
    if phone:
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": True}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        driver.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 1})
    return driver


PHONE_WIDTH = 800  # a screenshot narrower than this is taken as a phone's (the page stacks its columns below it)


def screenshot(html_path: Path, png: Path, quantity: str = "ratio", width: int = 1500, height: int = 1300):
    driver = headless_chromium(width, height, phone=width < PHONE_WIDTH)
    try:
        driver.get(html_path.resolve().as_uri())
        driver.execute_script("document.getElementById('quantity').value = arguments[0]; render();", quantity)
        driver.save_screenshot(str(png))
    finally:
        driver.quit()


def main(argv=None):
    parser = ArgumentParser(prog="python tools/show_traces.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, each with a traces.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="the page (default: FIRST_RUN/traces.html)")
    parser.add_argument("--step", type=int, default=None,
                        help="the traced step the page opens at (default: the first where a traced group has "
                        "signal)")  # fmt: skip
    parser.add_argument("--quantity", default="ratio", choices=QUANTITIES,
                        help="the colour the page opens on and the screenshot shows (default: ratio)")  # fmt: skip
    parser.add_argument("--screenshot", type=Path, default=None, help="also save a PNG of the page (selenium)")
    parser.add_argument("--width", type=int, default=1500,
                        help=f"the screenshot's width in pixels; under {PHONE_WIDTH}: a phone's touch screen "
                        "(default: 1500)")  # fmt: skip
    parser.add_argument("--height", type=int, default=1300, help="the screenshot's height in pixels (default: 1300)")
    args = parser.parse_args(argv)
    for name in ("width", "height"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    runs = [load_run(d) for d in args.runs]
    has_reference = any(c.get("ref_logp") for run in runs for r in run["records"] for c in r["completions"])
    if args.quantity == "kl" and not has_reference:
        parser.error("--quantity kl: no run has a reference model (ref_logp; PPO, or GRPO with --kl-coef > 0)")
    steps = sorted({r["step"] for run in runs for r in run["records"]})
    if args.step is not None and args.step not in steps:
        parser.error(f"--step {args.step}: no run has a trace at that step (traced steps: "
                     f"{', '.join(map(str, steps)) or 'none'})")  # fmt: skip
    out = args.out or args.runs[0] / "traces.html"
    out.write_text(page(runs, args.step, args.quantity))
    print(f"show_traces.py: wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    if args.screenshot:
        screenshot(out, args.screenshot, args.quantity, args.width, args.height)
        print(f"show_traces.py: wrote {args.screenshot}")


if __name__ == "__main__":
    sys.exit(main())
