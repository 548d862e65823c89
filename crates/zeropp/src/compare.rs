//! `zeropp compare`: ZeRO-3 (hierarchical routing, the baseline), ZeRO-3 with
//! flat routing, ZeRO++ and each technique alone on one workload; the table and
//! the SVG plots of their records.

use std::path::{Path, PathBuf};

use clap::Args;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use zeropp_engine::Backend;
use zeropp_engine::config::ZeroConfig;
use zeropp_engine::metrics::LinkBytes;
use zeropp_run::compare::{BASELINE, Comparison, FLAT_BASELINE, VariantResult, compare, standard_variants};
use zeropp_run::train::OP_TAGS;

use crate::CliError;
use crate::config::{RunArgs, build_config};
use crate::print::progress_bar;

/// Flags of `zeropp compare`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CompareArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Only ZeRO-3 (hierarchical and flat routing), full ZeRO++ and ZeRO++ with
    /// SDP4Bit's techniques (skip the single-technique ablations).
    #[arg(long = "no-ablation")]
    pub no_ablation: bool,
    /// Directory of the SVG plots (loss.svg, bytes.svg, ratios.svg).
    #[arg(long = "out", default_value = "zeropp-compare")]
    pub out: PathBuf,
}

/// Runs `zeropp compare`.
pub(crate) fn run(args: &CompareArgs) -> Result<(), CliError> {
    let crate::config::Planned { mut cfg, warnings } = build_config(&args.run, ZeroConfig::zero3())?;
    // The variants run one after another in this process, on simulated nodes.
    if cfg.run.backend == Backend::Mpi {
        return Err("zeropp compare runs on the thread backend (simulated nodes); drop --backend mpi".into());
    }
    cfg.run.backend = Backend::Threads;
    crate::print::print_warnings(&warnings);
    let mut variants = standard_variants(&cfg.run.engine.zero, cfg.run.local_size);
    if args.no_ablation {
        variants.retain(|v| [BASELINE, FLAT_BASELINE, "zeropp", "zeropp-delta"].contains(&v.name.as_str()));
    }
    let bars: Vec<_> =
        variants.iter().map(|v| progress_bar(cfg.run.steps, &format!("{:>10}", v.name))).collect();
    let result = compare(&cfg, &variants, &mut |i, r| {
        if let Some(pb) = bars.get(i) {
            pb.set_position(r.step as u64 + 1);
            pb.set_message(format!("loss {:.4} | {:.4} s/step", r.loss, r.step_time_s));
            if r.step + 1 == cfg.run.steps {
                pb.finish();
            }
        }
    })?;
    println!();
    if let Some(first) = result.results.first() {
        let s = &first.report.summary;
        println!("model {} ({:.3}M parameters), {} steps", s.model, s.params as f64 / 1e6, s.steps);
    }
    print!("{}", table(&result));
    for p in write_plots(&result, &args.out)? {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn mb(b: f64) -> String {
    format!("{:.3}", b / 1e6)
}

/// The side-by-side table of a comparison (markdown): routing, final/val loss, step time,
/// bytes per rank per step by link class, and each ratio against the
/// baseline with the ratio against flat ZeRO-3 beside it (`-` when flat
/// ZeRO-3 did not run).
pub(crate) fn table(cmp: &Comparison) -> String {
    let base = cmp.baseline().map_or(BASELINE, |b| b.variant.name.as_str());
    let flat = cmp.flat_baseline().map_or(FLAT_BASELINE, |f| f.variant.name.as_str());
    let mut s = format!(
        "| variant | routing | final loss | val loss | step time (s) | speedup vs {base} | speedup vs {flat} \
         | inter-node MB/rank/step | intra-node MB/rank/step | inter-node vs {base} | inter-node vs {flat} |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let or_dash = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}x"));
    for r in &cmp.results {
        let sm = &r.report.summary;
        let ratios = cmp.ratios(r);
        s.push_str(&format!(
            "| {} | {} | {:.4} | {} | {:.4} | {:.2}x | {} | {} | {} | {:.3}x | {} |\n",
            r.variant.name,
            r.variant.zero.routing.name(),
            sm.final_loss,
            sm.val_loss.map_or_else(|| "-".into(), |v| format!("{v:.4}")),
            sm.mean_step_time_s,
            ratios.baseline.speedup,
            or_dash(ratios.flat.map(|f| f.speedup), 2),
            mb(sm.bytes_per_step.inter),
            mb(sm.bytes_per_step.intra),
            ratios.baseline.inter_bytes,
            or_dash(ratios.flat.map(|f| f.inter_bytes), 3),
        ));
    }
    s
}

/// Draws one plot of a comparison into an SVG file.
type Plot = fn(&Comparison, &Path) -> Result<(), DrawError>;

/// What drawing a plot can fail with (plotters' error types, boxed).
type DrawError = Box<dyn std::error::Error>;

/// Writes `loss.svg` (loss curves), `bytes.svg` (bytes per rank per step by
/// operation and link class) and `ratios.svg` (every variant against the
/// hierarchical baseline, with flat ZeRO-3 beside it) into `dir`; returns their paths.
fn write_plots(cmp: &Comparison, dir: &Path) -> Result<Vec<PathBuf>, CliError> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let plots: [(&str, Plot); 3] =
        [("loss.svg", plot_loss), ("bytes.svg", plot_bytes), ("ratios.svg", plot_ratios)];
    let mut written = Vec::with_capacity(plots.len());
    for (name, plot) in plots {
        let path = dir.join(name);
        plot(cmp, &path).map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn plot_loss(cmp: &Comparison, path: &Path) -> Result<(), DrawError> {
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let steps = cmp.results.iter().map(|r| r.report.steps.len()).max().unwrap_or(1).max(2);
    let finite =
        cmp.results.iter().flat_map(|r| r.report.steps.iter().map(|s| s.loss)).filter(|l| l.is_finite());
    let (lo, hi) = finite.fold((f32::MAX, f32::MIN), |(a, b), l| (a.min(l), b.max(l)));
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(&root)
        .caption("training loss", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0usize..steps, (lo - pad)..(hi + pad))?;
    chart.configure_mesh().x_desc("step").y_desc("loss").draw()?;
    for (i, r) in cmp.results.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(usize, f32)> =
            r.report.steps.iter().filter(|s| s.loss.is_finite()).map(|s| (s.step, s.loss)).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(r.variant.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// Grouped bars: one group per variant, one bar per series; `values[g][s]` is
/// the height of series `s` in group `g`, `series[s]` its label and colour.
struct Bars<'a> {
    caption: &'a str,
    y_desc: &'a str,
    groups: Vec<String>,
    series: Vec<(String, RGBAColor)>,
    values: Vec<Vec<f64>>,
    /// A dashed horizontal reference line (e.g. a ratio of 1).
    reference: Option<f64>,
}

fn plot_bars(bars: &Bars<'_>, path: &Path) -> Result<(), DrawError> {
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = bars
        .values
        .iter()
        .flatten()
        .copied()
        .chain(bars.reference)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-6);
    let n = bars.groups.len().max(1);
    let per = bars.series.len() + 1;
    let mut chart = ChartBuilder::on(&root)
        .caption(bars.caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0f64..(n * per) as f64, 0.0..max * 1.1)?;
    // Group names are drawn under the middle of each group (mesh labels fall
    // wherever the axis puts its ticks, which need not be a group's middle).
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|_| String::new())
        .y_desc(bars.y_desc)
        .draw()?;
    let name_style = ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in bars.groups.iter().enumerate() {
        let middle = (g * per) as f64 + bars.series.len() as f64 / 2.0;
        let (x, y) = chart.backend_coord(&(middle, 0.0));
        root.draw(&Text::new(name.clone(), (x, y + 8), name_style.clone()))?;
    }
    for (si, (label, color)) in bars.series.iter().enumerate() {
        let color = color.filled();
        let rects: Vec<Rectangle<(f64, f64)>> = bars
            .values
            .iter()
            .enumerate()
            .map(|(g, row)| {
                let x = (g * per + si) as f64;
                let v = row.get(si).copied().filter(|v| v.is_finite()).unwrap_or(0.0);
                Rectangle::new([(x, 0.0), (x + 0.9, v)], color)
            })
            .collect();
        chart
            .draw_series(rects)?
            .label(label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color));
    }
    if let Some(y) = bars.reference {
        let line = DashedLineSeries::new([(0.0, y), ((n * per) as f64, y)], 6, 4, BLACK.stroke_width(1));
        chart.draw_series(line)?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

fn plot_bytes(cmp: &Comparison, path: &Path) -> Result<(), DrawError> {
    // One bar per (op, class): solid inter-node, light intra-node.
    let series: Vec<(&str, bool)> = OP_TAGS.iter().flat_map(|op| [(*op, false), (*op, true)]).collect();
    let value = |r: &VariantResult, op: &str, inter: bool| {
        let b: LinkBytes = r.report.summary.bytes_by_op.get(op).copied().unwrap_or_default();
        (if inter { b.inter } else { b.intra }) / 1e6
    };
    let bars = Bars {
        caption: "MB sent per rank per step, by operation (solid: inter-node, light: intra-node)",
        y_desc: "MB",
        groups: cmp.results.iter().map(|r| r.variant.name.clone()).collect(),
        series: series
            .iter()
            .enumerate()
            .map(|(si, (op, inter))| {
                let base = Palette99::pick(si / 2).to_rgba();
                let label = format!("{op} ({})", if *inter { "inter" } else { "intra" });
                (label, if *inter { base } else { base.mix(0.35) })
            })
            .collect(),
        values: cmp
            .results
            .iter()
            .map(|r| series.iter().map(|(op, inter)| value(r, op, *inter)).collect())
            .collect(),
        reference: None,
    };
    plot_bars(&bars, path)
}

fn plot_ratios(cmp: &Comparison, path: &Path) -> Result<(), DrawError> {
    let base = cmp.baseline().map_or(BASELINE, |b| b.variant.name.as_str());
    let flat = cmp.flat_baseline().map_or(FLAT_BASELINE, |f| f.variant.name.as_str());
    let (bytes, speed) = (Palette99::pick(0).to_rgba(), Palette99::pick(1).to_rgba());
    let caption = format!("ratios to {base} (hierarchical; solid) and to {flat} (light)");
    let bars = Bars {
        caption: &caption,
        y_desc: "ratio",
        groups: cmp.results.iter().map(|r| r.variant.name.clone()).collect(),
        series: vec![
            (format!("inter-node bytes vs {base}"), bytes),
            (format!("inter-node bytes vs {flat}"), bytes.mix(0.35)),
            (format!("speedup vs {base}"), speed),
            (format!("speedup vs {flat}"), speed.mix(0.35)),
        ],
        values: cmp
            .results
            .iter()
            .map(|r| {
                let q = cmp.ratios(r);
                let flat = |f: fn(&zeropp_run::compare::Ratios) -> f64| q.flat.as_ref().map_or(f64::NAN, f);
                vec![q.baseline.inter_bytes, flat(|f| f.inter_bytes), q.baseline.speedup, flat(|f| f.speedup)]
            })
            .collect(),
        reference: Some(1.0),
    };
    plot_bars(&bars, path)
}
