//! SVG plots of reserved and allocated bytes over a replay, one chart per
//! workload, one colour per policy (reserved solid, allocated thin).

use std::path::Path;

use plotters::prelude::*;

use crate::replay::Sample;

/// One series to draw: a policy's samples on one workload.
pub struct Series<'a> {
    /// Legend label (the policy).
    pub label: &'a str,
    /// The samples.
    pub samples: &'a [Sample],
}

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw {path}: {message}")]
pub struct PlotError {
    /// The output file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws one chart per `(title, series)` into the SVG file `path`.
pub fn draw(path: &Path, charts: &[(String, Vec<Series<'_>>)]) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError { path: path.display().to_string(), message: e.to_string() };
    let height = 420 * charts.len().max(1) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((charts.len().max(1), 1));
    for ((title, series), area) in charts.iter().zip(areas.iter()) {
        let max_x = series.iter().flat_map(|s| s.samples.last()).map(|s| s.event).max().unwrap_or(1).max(1);
        let max_y = series.iter().flat_map(|s| s.samples.iter()).map(|s| s.reserved).max().unwrap_or(1).max(1);
        let gib = (1u64 << 30) as f64;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0u64..max_x, 0f64..(max_y as f64 / gib) * 1.05)
            .map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("event").y_desc("GiB").draw().map_err(|e| err(&e))?;
        for (i, s) in series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    s.samples.iter().map(|p| (p.event, p.reserved as f64 / gib)),
                    c.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!("{} reserved", s.label))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            chart
                .draw_series(LineSeries::new(
                    s.samples.iter().map(|p| (p.event, p.allocated as f64 / gib)),
                    c.mix(0.5).stroke_width(1),
                ))
                .map_err(|e| err(&e))?
                .label(format!("{} allocated", s.label))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.mix(0.5).stroke_width(1)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
