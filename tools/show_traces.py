"""One self-contained HTML page from the traces of one or more runs (OUT/traces.jsonl, written by
--trace-every; the record format is docs/traces.md), side by side:

    python tools/show_traces.py runs/grpo runs/gspo                # -> runs/grpo/traces.html
    python tools/show_traces.py runs/grpo runs/gspo --out page.html --screenshot docs/traces.png --step 10

Each completion is a row of tokens, coloured by the quantity chosen at the top (advantage, ratio,
clipped, entropy, KL to the reference, the token's own log-ratio); hovering a token shows its
numbers; the step selector moves through training. The page opens on the ratio (as the README's
picture shows it) at the first traced step: --quantity and --step choose others. Prompt tokens
are grey and outlined, padding dotted, the EOS token marked. The page holds its data and its one
small script inline: no network, no external file. --screenshot needs selenium and Debian's
chromium and chromium-driver.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, when run as a script
from common import ArgumentParser, die  # noqa: E402  (one-line errors, exit status 2)

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
    return {"label": f"{algo}  ({directory.name})", "algo": algo, "settings": settings, "records": records}


STYLE = """
body { font: 13px/1.45 system-ui, sans-serif; margin: 12px; color: #222; }
header { position: sticky; top: 0; background: #fff; padding: 6px 0; border-bottom: 1px solid #ccc; z-index: 2; }
header label { margin-right: 14px; }
#legend { margin-left: 8px; color: #555; }
.runs { display: grid; gap: 18px; margin-top: 10px; }
.run h2 { font-size: 15px; margin: 4px 0; }
.run .settings, .scale { color: #666; font-size: 12px; }
.group { margin: 10px 0 14px; padding-top: 4px; border-top: 1px solid #eee; }
.line { white-space: nowrap; margin: 2px 0; font-family: ui-monospace, monospace; }
.line span { display: inline-block; min-width: 9px; padding: 1px 2px; margin: 0 1px; border-radius: 2px; }
.prompt { color: #777; background: #f3f3f3; outline: 1px solid #ddd; }
.pad { color: #bbb; border: 1px dotted #bbb; }
.tok { cursor: default; }
.tok.eos { font-weight: bold; border-bottom: 2px solid #333; }
.tok.null { background: repeating-linear-gradient(45deg, #eee, #eee 3px, #fff 3px, #fff 6px); color: #888; }
.note { font-family: system-ui, sans-serif; color: #666; font-size: 12px; margin-left: 8px; }
#tip { position: fixed; display: none; background: #fffff0; border: 1px solid #999; padding: 6px 8px;
       font: 12px ui-monospace, monospace; white-space: pre; z-index: 3; pointer-events: none; }
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
function entryOf(c, which) {
  if (!c.updates) return null;
  return which === 'first' ? c.updates[0] : c.updates[c.updates.length - 1];
}
function valueOf(c, t, q, which) {
  const u = entryOf(c, which);
  if (q === 'advantage') return Array.isArray(c.advantage) ? c.advantage[t] : c.advantage;
  if (q === 'entropy') return c.entropy ? c.entropy[t] : null;
  if (q === 'kl') return c.ref_logp ? c.old_logp[t] - c.ref_logp[t] : null;
  if (!u) return null;
  if (q === 'ratio') return u.ratio ? Math.log(u.ratio[t]) : null;
  if (q === 'clipped') return u.clipped ? (u.clipped[t] ? 1 : 0) : null;
  if (q === 'log_ratio') return u.logp[t] - c.old_logp[t];
  return null;
}
function colour(v, q, scale) {
  if (q === 'clipped') return v ? 'rgb(255,140,0)' : 'rgb(225,240,225)';
  const x = Math.max(-1, Math.min(1, v / (scale || 1)));
  if (q === 'entropy') return `rgba(120,60,200,${(0.08 + 0.8 * Math.abs(x)).toFixed(3)})`;
  return x >= 0 ? `rgba(220,50,40,${(0.06 + 0.8 * x).toFixed(3)})` : `rgba(40,90,220,${(0.06 - 0.8 * x).toFixed(3)})`;
}
function fmt(v) { return v === null || v === undefined ? 'null' : String(v); }
function tipText(c, t, rec) {
  const lines = [`token ${JSON.stringify(c.tokens[t])}  id ${c.ids[t]}  position ${t}  row ${c.row}`,
                 `reward ${fmt(c.reward)}  ${JSON.stringify(c.rewards)}`];
  const adv = Array.isArray(c.advantage) ? c.advantage[t] : c.advantage;
  lines.push(`advantage ${fmt(adv)}`);
  for (const k of ['old_logp', 'mu', 'ref_logp', 'entropy', 'value', 'token_reward'])
    lines.push(`${k} ${fmt(c[k] ? c[k][t] : null)}`);
  if (!c.updates) lines.push('updates null (no update forwarded this row)');
  else for (const u of c.updates)
    lines.push(`update ${u.update}: logp ${fmt(u.logp[t])}  ratio ${fmt(u.ratio ? u.ratio[t] : null)}  ` +
               `clipped ${fmt(u.clipped ? u.clipped[t] : null)}`);
  return lines.join('\n');
}
function span(text, cls) {
  const s = document.createElement('span');
  s.className = cls; s.textContent = text; return s;
}
function render() {
  const step = Number($('step').value), q = $('quantity').value, which = $('update').value;
  $('legend').textContent = QUANTITIES[q] + (q === 'clipped' ? ': orange clipped, green not, striped null'
                              : ': blue < 0 < red, striped null; hover a token for its numbers');
  const root = $('runs');
  root.replaceChildren();
  root.style.gridTemplateColumns = `repeat(${DATA.runs.length}, minmax(0, 1fr))`;
  for (const run of DATA.runs) {
    const col = document.createElement('div');
    col.className = 'run';
    const h = document.createElement('h2'); h.textContent = run.label; col.appendChild(h);
    col.appendChild(span(Object.entries(run.settings).map(([k, v]) => `${k} ${v}`).join(', '), 'settings'));
    const records = run.records.filter((r) => r.step === step);
    let scale = 0;
    for (const r of records) for (const c of r.completions) for (let t = 0; t < c.ids.length; t++) {
      const v = valueOf(c, t, q, which);
      if (v !== null && isFinite(v)) scale = Math.max(scale, Math.abs(v));
    }
    col.appendChild(span(q === 'clipped' ? '' : `  colour scale +-${scale.toPrecision(3)}` +
                         (q === 'ratio' ? ' (log ratio)' : ''), 'scale'));
    if (!records.length) col.appendChild(span('  no trace at this step', 'note'));
    for (const r of records) {
      const g = document.createElement('div'); g.className = 'group';
      const p = document.createElement('div'); p.className = 'line';
      for (let i = 0; i < r.prompt.pad; i++) p.appendChild(span(' ', 'pad'));
      for (const t of r.prompt.tokens) p.appendChild(span(t, 'prompt'));
      p.appendChild(span(`group ${r.group}  answer ${fmt(r.answer)}`, 'note'));
      g.appendChild(p);
      for (const c of r.completions) {
        const line = document.createElement('div'); line.className = 'line';
        c.tokens.forEach((text, t) => {
          const v = valueOf(c, t, q, which);
          const eos = c.eos && t === c.tokens.length - 1;
          const s = span(text, 'tok' + (eos ? ' eos' : '') + (v === null ? ' null' : ''));
          if (v !== null) s.style.background = colour(v, q, scale);
          s.dataset.row = c.row; s.dataset.t = t;
          s.addEventListener('mouseenter', (e) => {
            $('tip').textContent = tipText(c, t, r); $('tip').style.display = 'block';
            $('tip').style.left = (e.clientX + 12) + 'px'; $('tip').style.top = (e.clientY + 14) + 'px';
          });
          s.addEventListener('mouseleave', () => { $('tip').style.display = 'none'; });
          line.appendChild(s);
        });
        for (let i = 0; i < c.pad; i++) line.appendChild(span(' ', 'pad'));
        const adv = Array.isArray(c.advantage) ? 'per token' : c.advantage.toPrecision(3);
        const notes = [`reward ${fmt(c.reward)}`, `A ${adv}`];
        if (!c.eos) notes.push('truncated');
        if (!c.updates) notes.push('not forwarded: updates null');
        line.appendChild(span(notes.join('  '), 'note'));
        g.appendChild(line);
      }
      col.appendChild(g);
    }
    root.appendChild(col);
  }
}
const steps = [...new Set(DATA.runs.flatMap((r) => r.records.map((x) => x.step)))].sort((a, b) => a - b);
for (const s of steps) $('step').add(new Option(String(s), String(s)));
for (const [k, v] of Object.entries(QUANTITIES)) $('quantity').add(new Option(k, k));
$('quantity').value = DATA.quantity;
if (DATA.step !== null && steps.includes(DATA.step)) $('step').value = String(DATA.step);
for (const id of ['step', 'quantity', 'update']) $(id).addEventListener('change', render);
render();
"""


def page(runs: list[dict], step: int | None = None, quantity: str = "ratio") -> str:
    """The HTML page; `step`: the one it opens at (default: the first); `quantity`: the colour it opens on."""
    data = json.dumps({"runs": runs, "step": step, "quantity": quantity})
    # inside <script>: no "</script>" can end it early, and no "http://" appears even in a token's text
    data = data.replace("<", "\\u003c").replace("/", "\\/")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>traces: {" | ".join(r["label"] for r in runs)}</title>
<style>{STYLE}</style></head>
<body>
<header>
<label>step <select id="step"></select></label>
<label>colour <select id="quantity"></select></label>
<label>update <select id="update"><option value="last">last</option>
<option value="first">first</option></select></label>
<span id="legend"></span>
</header>
<div id="runs" class="runs"></div>
<div id="tip"></div>
<script type="application/json" id="traces">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def headless_chromium(width: int = 1500, height: int = 950):
    """Selenium's Chrome driver on Debian's chromium, headless, with the network off (the page must
    need none). Raises if selenium, chromium or chromium-driver is missing."""
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
    return driver


def screenshot(html_path: Path, png: Path, quantity: str = "ratio", height: int = 1300):
    driver = headless_chromium(1500, height)
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
    parser.add_argument("--step", type=int, default=None, help="the traced step the page opens at (default: the first)")
    parser.add_argument("--quantity", default="ratio", choices=QUANTITIES,
                        help="the colour the page opens on and the screenshot shows (default: ratio)")  # fmt: skip
    parser.add_argument("--screenshot", type=Path, default=None, help="also save a PNG of the page (selenium)")
    parser.add_argument("--height", type=int, default=1300, help="the screenshot's height in pixels (default: 1300)")
    args = parser.parse_args(argv)
    if args.height < 1:
        parser.error(f"--height must be >= 1, got {args.height}")
    runs = [load_run(d) for d in args.runs]
    steps = sorted({r["step"] for run in runs for r in run["records"]})
    if args.step is not None and args.step not in steps:
        parser.error(f"--step {args.step}: no run has a trace at that step (traced steps: "
                     f"{', '.join(map(str, steps)) or 'none'})")  # fmt: skip
    out = args.out or args.runs[0] / "traces.html"
    out.write_text(page(runs, args.step, args.quantity))
    print(f"show_traces.py: wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    if args.screenshot:
        screenshot(out, args.screenshot, args.quantity, args.height)
        print(f"show_traces.py: wrote {args.screenshot}")


if __name__ == "__main__":
    sys.exit(main())
