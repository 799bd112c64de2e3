//! The memory-at-scale chart: two panels against turns completed, the runtimes' total PSS
//! above and the pool's own RSS and live heap (with its 50 MiB RSS target) below, drawn with plotters into an
//! RGB buffer and written as a PNG. Text uses one embedded font (Hack, from
//! `epaint_default_fonts`) registered with plotters' ab_glyph renderer, so the chart draws
//! the same on a machine without any system font or fontconfig.
//!
//! This module owns the drawing and the PNG encoding; the samples come from `scale`.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

/// Width and height of the chart in pixels.
const SIZE: (u32, u32) = (1200, 800);
/// The family name the embedded font is registered under.
const FONT: &str = "sans-serif";

/// One point of each curve.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    pub turns: f64,
    pub runtimes_pss_mib: f64,
    pub pool_rss_mib: f64,
    pub pool_heap_mib: f64,
}

/// What the chart says besides its curves.
pub struct Labels<'a> {
    /// The first line of the title (the workload).
    pub title: &'a str,
    /// Turns completed when warm-up ended (a vertical marker on both panels), if it did.
    pub warm_up_turns: Option<f64>,
    /// The pool's RSS target, drawn as a horizontal line on the lower panel.
    pub pool_target_mib: f64,
}

/// Registers the embedded font once per process.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!(
            "the embedded chart font (Hack) did not load: the epaint_default_fonts build is broken"
        ))
    }
}

/// Draws `points` and writes the chart to `path` as a PNG.
pub fn draw(points: &[Point], labels: &Labels, path: &Path) -> Result<()> {
    let png = render(points, labels)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating {} for the chart", dir.display()))?;
    }
    std::fs::write(path, png).with_context(|| {
        format!(
            "writing the chart to {} (pass --png with a writable path)",
            path.display()
        )
    })
}

/// The chart as PNG bytes.
pub fn render(points: &[Point], labels: &Labels) -> Result<Vec<u8>> {
    register_font()?;
    let (w, h) = SIZE;
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let root = root
            .titled(labels.title, (FONT, 22).into_font())
            .map_err(plot_error)?;
        let panels = root.split_evenly((2, 1));
        let max_turns = points.iter().map(|p| p.turns).fold(1.0_f64, f64::max);
        panel(
            &panels[0],
            "runtimes' total PSS (MiB), every process under serve; grey: warm-up's end",
            &[(
                points
                    .iter()
                    .map(|p| (p.turns, p.runtimes_pss_mib))
                    .collect(),
                BLUE,
            )],
            max_turns,
            None,
            labels.warm_up_turns,
        )?;
        panel(
            &panels[1],
            "pool (serve) MiB: RSS green, live heap orange; red: the 50 MiB RSS target",
            &[
                (
                    points.iter().map(|p| (p.turns, p.pool_rss_mib)).collect(),
                    GREEN_LINE,
                ),
                (
                    points.iter().map(|p| (p.turns, p.pool_heap_mib)).collect(),
                    ORANGE_LINE,
                ),
            ],
            max_turns,
            Some(labels.pool_target_mib),
            labels.warm_up_turns,
        )?;
        root.present().map_err(plot_error)?;
    }
    encode_png(&rgb, SIZE)
}

/// The pool's RSS curve.
const GREEN_LINE: RGBColor = RGBColor(0, 128, 0);
/// The pool's live heap curve.
const ORANGE_LINE: RGBColor = RGBColor(230, 120, 0);

/// One curve: its points and its colour.
type Curve = (Vec<(f64, f64)>, RGBColor);

/// One panel: curves against turns, optionally a horizontal target and the warm-up marker.
fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    caption: &str,
    curves: &[Curve],
    max_turns: f64,
    target: Option<f64>,
    warm_up: Option<f64>,
) -> Result<()> {
    let top = curves
        .iter()
        .flat_map(|(points, _)| points.iter().map(|(_, y)| *y))
        .chain(target)
        .fold(1.0_f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18).into_font())
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_turns, 0.0..top)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("turns completed")
        .y_desc("MiB")
        .label_style((FONT, 14).into_font())
        .axis_desc_style((FONT, 15).into_font())
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(plot_error)?;
    if let Some(target) = target {
        chart
            .draw_series(LineSeries::new(
                [(0.0, target), (max_turns, target)],
                RED.stroke_width(1),
            ))
            .map_err(plot_error)?;
    }
    if let Some(turns) = warm_up {
        chart
            .draw_series(LineSeries::new(
                [(turns, 0.0), (turns, top)],
                BLACK.mix(0.5).stroke_width(2),
            ))
            .map_err(plot_error)?;
    }
    for (points, color) in curves {
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(plot_error)?;
    }
    Ok(())
}

/// plotters' errors carry the backend's error type; the chart only needs their message.
fn plot_error<E: std::fmt::Display>(error: E) -> anyhow::Error {
    anyhow!("drawing the chart: {error}")
}

/// An 8-bit RGB buffer as PNG bytes.
fn encode_png(rgb: &[u8], (w, h): (u32, u32)) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .context("encoding the chart's PNG header")?;
        writer
            .write_image_data(rgb)
            .context("encoding the chart's pixels as PNG")?;
        writer.finish().context("finishing the chart's PNG")?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_a_png_of_its_size_with_the_curves_drawn_in_their_colours() {
        let points: Vec<Point> = (0..=20)
            .map(|i| Point {
                turns: f64::from(i) * 50.0,
                runtimes_pss_mib: 400.0 + f64::from(i % 5) * 20.0,
                pool_rss_mib: 20.0 + f64::from(i) * 0.1,
                pool_heap_mib: 10.0 + f64::from(i) * 0.1,
            })
            .collect();
        let labels = Labels {
            title: "test chart",
            // No marker: its grey would pass for text below.
            warm_up_turns: None,
            pool_target_mib: 50.0,
        };
        let png = render(&points, &labels).expect("a chart");
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().expect("a PNG header");
        let mut pixels = vec![0; reader.output_buffer_size().expect("a size")];
        let info = reader.next_frame(&mut pixels).expect("one frame");
        assert_eq!((info.width, info.height), SIZE);
        let count = |rgb: [u8; 3]| pixels.chunks(3).filter(|p| *p == rgb).count();
        // The runtimes' curve (blue), the pool's (green) and the target (red) were drawn,
        // and text was rendered (anti-aliased glyphs leave greys that no line has).
        assert!(count([0, 0, 255]) > 500, "blue curve");
        assert!(count([0, 128, 0]) > 500, "green curve");
        assert!(count([230, 120, 0]) > 500, "orange curve");
        assert!(count([255, 0, 0]) > 500, "red target");
        let greys = pixels
            .chunks(3)
            .filter(|p| p[0] == p[1] && p[1] == p[2] && p[0] > 40 && p[0] < 200)
            .count();
        assert!(greys > 200, "text drawn: {greys} grey pixels");
    }
}
