//! What `zeropp plan` prints: the table of one plan, where each mode's
//! speedup crosses 1.1x over a sweep, and the SVG of the speedup against the
//! inter-node bandwidth.

use plotters::prelude::*;
use zeropp_run::plan::Plan;

/// The cluster as the flags gave it, for the table's header.
pub(crate) struct ClusterLine<'a> {
    /// Nodes.
    pub(crate) nodes: usize,
    /// GPUs per node.
    pub(crate) gpus_per_node: usize,
    /// `--inter` as given.
    pub(crate) inter: &'a str,
    /// `--intra` as given, if it was.
    pub(crate) intra: Option<&'a str>,
}

/// Gigabytes, with two decimals, or three significant digits below 0.1 GB
/// (a test model's megabytes would all print as 0.00).
fn gb(bytes: f64) -> String {
    small(bytes / 1e9, 2)
}

/// `x` with `decimals` decimals where those show at least two significant
/// digits, else with as many as three significant digits take (0.0143, not
/// 0.0; at most 12 decimals).
fn small(x: f64, decimals: usize) -> String {
    let shows_two = x == 0.0 || !x.is_finite() || x.abs() >= 10f64.powi(1 - decimals as i32);
    let d = if shows_two { decimals } else { ((2.0 - x.abs().log10().floor()) as usize).clamp(decimals, 12) };
    format!("{x:.d$}")
}

/// The table of one plan.
pub(crate) fn table(p: &Plan, c: &ClusterLine<'_>) -> String {
    let mut s = format!(
        "model: {} parameters ({} blocks, width {}, vocab {}, context {}), {} tokens/GPU/micro-batch\n\
         cluster: {} GPUs ({} nodes x {}), inter {} per node, intra {} per GPU, GPU {}\n\
         compute: {}; link efficiency {}, overlap {:?} (docs/PERFORMANCE.md, \"Planning\")\n\n",
        if p.params >= 1_000_000_000 {
            format!("{:.2}B", p.params as f64 / 1e9)
        } else {
            format!("{:.2}M", p.params as f64 / 1e6)
        },
        p.layers,
        p.hidden,
        p.vocab,
        p.seq,
        p.tokens,
        p.gpus,
        c.nodes,
        c.gpus_per_node,
        c.inter,
        match c.intra {
            Some(v) => v.to_string(),
            None => format!("{}GB/s (the GPU's NVLink)", p.intra_bytes_per_s / 1e9),
        },
        p.gpu,
        p.compute_model,
        p.link_efficiency,
        p.overlap,
    );
    s.push_str(
        "| mode | step (s) | speedup | TFLOP/s per GPU | compute (s) | exposed comm (s) | inter-node GB/GPU | intra-node GB/GPU | memory GB/GPU | of it, states GB/GPU |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for name in &p.order {
        if let Some(m) = p.modes.get(name) {
            let exposed: f64 = m.exposed_s.values().sum();
            s.push_str(&format!(
                "| {name} | {:.3} | {:.2}x | {} | {:.3} | {:.3} | {} | {} | {} | {} |\n",
                m.step_s,
                m.speedup,
                small(m.tflops_per_gpu, 1),
                m.compute_s,
                exposed,
                gb(m.inter_node_bytes),
                gb(m.intra_node_bytes),
                gb(m.memory_bytes),
                gb(m.state_bytes),
            ));
        }
    }
    s
}

/// Where each mode's speedup over the first crosses 1.1x in the sweep.
pub(crate) fn crossings(order: &[String], points: &[(f64, Plan)]) -> String {
    let mut s = String::from("\n| mode | speedup >= 1.1x below (inter-node, per node) |\n|---|---|\n");
    for name in order.iter().skip(1) {
        let speedup = |p: &Plan| p.modes.get(name).map_or(0.0, |m| m.speedup);
        // The highest bandwidth at which the speedup is still at least 1.1x.
        let last = points.iter().rev().find(|(_, p)| speedup(p) >= 1.1);
        let text = match last {
            Some((bw, _)) if points.last().is_some_and(|(top, _)| bw >= top) => "the whole range".to_string(),
            Some((bw, _)) => format!("{:.0} Gbit/s", bw * 8.0 / 1e9),
            None => "nowhere in the range".to_string(),
        };
        s.push_str(&format!("| {name} | {text} |\n"));
    }
    s
}

type DrawError = Box<dyn std::error::Error>;

/// The speedup of every mode over the first against the inter-node bandwidth.
pub(crate) fn draw(
    path: &std::path::Path,
    order: &[String],
    points: &[(f64, Plan)],
) -> Result<(), DrawError> {
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let gbits = |bw: f64| bw * 8.0 / 1e9;
    let (lo, hi) = match (points.first(), points.last()) {
        (Some((a, _)), Some((b, _))) => (gbits(*a), gbits(*b)),
        _ => return Err("no sweep points".into()),
    };
    let top = points.iter().flat_map(|(_, p)| p.modes.values().map(|m| m.speedup)).fold(1.2f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("speedup over {}", order.first().map_or("", String::as_str)), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..top * 1.05)?;
    chart.configure_mesh().x_desc("inter-node bandwidth per node (Gbit/s)").y_desc("speedup").draw()?;
    for (i, name) in order.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> =
            points.iter().filter_map(|(bw, p)| p.modes.get(name).map(|m| (gbits(*bw), m.speedup))).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart.draw_series(LineSeries::new(vec![(lo, 1.1), (hi, 1.1)], BLACK.mix(0.4)))?;
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_figures_keep_three_significant_digits() {
        for (x, decimals, shown) in [
            (0.86, 2, "0.86"),
            (0.0362, 2, "0.0362"),
            (3.62e-5, 2, "0.0000362"),
            (45.3, 1, "45.3"),
            (0.5, 1, "0.500"),
            (0.0143, 1, "0.0143"),
            (0.0, 2, "0.00"),
            (1e-20, 2, "0.000000000000"),
        ] {
            assert_eq!(small(x, decimals), shown, "{x}");
        }
    }
}
