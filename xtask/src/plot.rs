//! What the benches' SVG plots share: the legend box and the final write.

use plotters::coord::Shift;
use plotters::coord::ranged1d::Ranged;
use plotters::prelude::*;

/// Draws `chart`'s series labels in a framed white box, then writes `area`
/// (the SVG file).
pub(crate) fn legend_and_present<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    area: &DrawingArea<SVGBackend<'a>, Shift>,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    area.present().map_err(|e| e.to_string())
}
