//! `--svg`: the chart of throughput and commands per section.

use std::path::Path;

use crate::Res;
use crate::report::{fmt_pct, fmt_rate};
use crate::results::{ConfigResult, StrategyResult};
use crate::settings::config_label;

/// Draws throughput (with each configuration's ideal as a dashed reference line) and
/// commands per section for one or more configurations, one bar per strategy.
pub fn draw_svg(path: &Path, title: &str, configs: &[ConfigResult]) -> Res<()> {
    use plotters::coord::combinators::IntoLogRange;
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    // One slot per strategy result, configurations side by side.
    let many = configs.len() > 1;
    let bars: Vec<(String, &StrategyResult)> = configs
        .iter()
        .flat_map(|c| {
            let label = config_label(&c.settings);
            c.results.iter().map(move |r| {
                let name = if many {
                    format!("{label} {}", r.strategy.name())
                } else {
                    r.strategy.name().to_owned()
                };
                (name, r)
            })
        })
        .collect();
    // (first slot, last slot, ideal rate) per configuration.
    let mut groups = Vec::new();
    let mut slot = 0;
    for c in configs {
        let n = c.results.len();
        if n > 0 {
            groups.push((slot, slot + n - 1, c.ideal.sections_per_s));
        }
        slot += n;
    }
    let n = bars.len();
    let x_range = || Slots(n);
    let label = |x: &f64| -> String {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            bars.get(i as usize)
                .map_or(String::new(), |(name, _)| name.clone())
        } else {
            String::new()
        }
    };
    // Throughput labels go inside the bars' tops, clear of the ideal line just above.
    let inside = TextStyle::from(("sans-serif", 14).into_font())
        .color(&WHITE)
        .pos(Pos::new(HPos::Center, VPos::Top));
    let panel = (130 * n as u32).max(600);

    let root = SVGBackend::new(path, (2 * panel, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (left, right) = root.split_horizontally(panel);

    // Left: throughput, log scale (polling at 100 ms is orders of magnitude slower).
    let rates = || {
        bars.iter()
            .map(|(_, r)| r.sections_per_s)
            .chain(groups.iter().map(|g| g.2))
    };
    let max_rate = rates().fold(1.0f64, f64::max);
    let min_rate = rates().fold(f64::INFINITY, f64::min).max(0.1);
    let y_lo = 10f64.powf(min_rate.log10().floor()).clamp(0.1, 1.0);
    let y_hi = 10f64.powf((max_rate * 3.0).log10().ceil());
    let mut chart = ChartBuilder::on(&left)
        .caption("throughput", ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range(), (y_lo..y_hi).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(if many {
            "configuration (processes×threads) and strategy"
        } else {
            "strategy"
        })
        .y_desc("critical sections per second (log scale)")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y}"))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
        let x = i as f64;
        let color = Palette99::pick(if many { i % 2 + 2 } else { i });
        Rectangle::new(
            [(x - 0.32, y_lo), (x + 0.32, r.sections_per_s.max(y_lo))],
            color.filled(),
        )
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
        Text::new(
            format!("{} ({})", fmt_rate(r.sections_per_s), fmt_pct(r.pct_ideal)),
            (i as f64, r.sections_per_s.max(y_lo) / 1.08),
            inside.clone(),
        )
    }))?;
    let ideal_color = RGBColor(200, 30, 30);
    chart
        .draw_series(groups.iter().map(|&(a, b, rate)| {
            plotters::element::DashedPathElement::new(
                [(a as f64 - 0.45, rate), (b as f64 + 0.45, rate)],
                8,
                5,
                ideal_color.stroke_width(2),
            )
        }))?
        .label("ideal: the same sections in 1 thread with no lock")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], ideal_color.stroke_width(2)));
    let ideal_text = TextStyle::from(("sans-serif", 13).into_font())
        .color(&ideal_color)
        .pos(Pos::new(HPos::Left, VPos::Bottom));
    chart.draw_series(groups.iter().map(|&(a, _, rate)| {
        Text::new(
            format!("ideal {}", fmt_rate(rate)),
            (a as f64 - 0.43, rate * 1.04),
            ideal_text.clone(),
        )
    }))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()?;

    // Right: commands per critical section, two bars per strategy.
    let max_cmds = bars
        .iter()
        .map(|(_, r)| r.commands.lock_per_section.max(r.commands.sent_per_section))
        .fold(0.0f64, f64::max);
    let y_hi = (max_cmds * 1.2).max(1.0);
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "Redis commands per critical section (counter GET+SET excluded)",
            ("sans-serif", 18),
        )
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range(), 0f64..y_hi)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(if many {
            "configuration (processes×threads) and strategy"
        } else {
            "strategy"
        })
        .y_desc("commands per critical section")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| {
            if y_hi >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.1}")
            }
        })
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let all_color = RGBColor(70, 110, 190);
    let sent_color = RGBColor(235, 145, 50);
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.38, 0.0), (x - 0.02, r.commands.lock_per_section)],
                all_color.filled(),
            )
        }))?
        .label("all commands (incl. those run inside Lua scripts)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], all_color.filled()));
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
            let x = i as f64;
            Rectangle::new(
                [(x + 0.02, 0.0), (x + 0.38, r.commands.sent_per_section)],
                sent_color.filled(),
            )
        }))?
        .label("commands sent by clients (round trips)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], sent_color.filled()));
    let small =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(bars.iter().enumerate().flat_map(|(i, (_, r))| {
        let x = i as f64;
        [
            Text::new(
                format!("{:.2}", r.commands.lock_per_section),
                (x - 0.2, r.commands.lock_per_section + y_hi * 0.01),
                small.clone(),
            ),
            Text::new(
                format!("{:.2}", r.commands.sent_per_section),
                (x + 0.2, r.commands.sent_per_section + y_hi * 0.01),
                small.clone(),
            ),
        ]
    }))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
}

/// An x axis of `n` slots centred on 0, 1, .. n-1, with one key point (label) per slot.
pub struct Slots(usize);

impl plotters::coord::ranged1d::Ranged for Slots {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let r = self.range();
        let frac = (value - r.start) / (r.end - r.start);
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        (0..self.0).map(|i| i as f64).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        -0.5..self.0 as f64 - 0.5
    }
}
