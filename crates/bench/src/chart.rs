//! `thorn bench chart`: TTFT per turn against the turn's prompt length, one series per agentic report (one
//! per endpoint), as an SVG. With prefix reuse TTFT stays flat as the conversation grows; without it, it
//! climbs with the prompt.

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

const COLORS: [RGBColor; 6] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// One series: a label and its (prompt tokens, TTFT seconds) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Reads the per-turn points of an agentic report (label: `LABEL=FILE`, else the report's endpoint).
pub fn series(arg: &str) -> Result<Series> {
    let (label, file) = match arg.split_once('=') {
        Some((l, f)) => (Some(l.to_owned()), PathBuf::from(f)),
        None => (None, PathBuf::from(arg)),
    };
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?,
    )
    .with_context(|| format!("{} is not JSON", file.display()))?;
    let points = r["per_turn"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| Some((t["prompt_tokens"].as_f64()?, t["ttft_s"].as_f64()?)))
        .collect();
    Ok(Series {
        label: label.unwrap_or_else(|| r["endpoint"].as_str().unwrap_or("endpoint").to_owned()),
        points,
    })
}

/// Draws the series into an SVG at `out`.
pub fn draw(all: &[Series], out: &Path) -> Result<()> {
    let xmax = all
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(1.0, f64::max)
        * 1.05;
    let ymax = all
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.1, f64::max)
        * 1.1;
    let root = SVGBackend::new(out, (900, 540)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the chart: {e}");
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Agentic replay: time to first token per turn",
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("prompt tokens (context length of the turn)")
        .y_desc("TTFT (s)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in all.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts = s.points.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| Circle::new((x + 8, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_every_series() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ttft.svg");
        let series = vec![
            Series {
                label: "thorn".into(),
                points: vec![(1500.0, 0.4), (3000.0, 0.5)],
            },
            Series {
                label: "llama.cpp".into(),
                points: vec![(1500.0, 2.0), (3000.0, 4.1)],
            },
        ];
        draw(&series, &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("thorn") && svg.contains("llama.cpp"));
        assert_eq!(
            svg.matches("<circle").count(),
            4 + 2,
            "4 points and 2 legend marks"
        );
    }
}
