//! A line chart as SVG text: throughput against clients or connections,
//! one line per backend, for `docs/performance.md`. The x axis is
//! logarithmic (1, 8, 64, 256 clients are evenly spaced), the y axis linear
//! from zero. No dependency: the chart is a few dozen SVG elements.

use std::fmt::Write as _;

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// One line of the chart: its label and a y value per x (NaN: no point).
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// One value per x, in the order of the chart's `xs`.
    pub ys: Vec<f64>,
}

/// The chart as a standalone SVG document. `xs` must be positive.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    xs: &[f64],
    series: &[Series],
) -> String {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let (lo, hi) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x.ln()), hi.max(x.ln()))
        });
    let x_at = |x: f64| {
        LEFT + if hi > lo {
            (x.ln() - lo) / (hi - lo) * plot_w
        } else {
            plot_w / 2.0
        }
    };
    let y_max = nice_ceiling(
        series
            .iter()
            .flat_map(|s| s.ys.iter().copied())
            .filter(|y| y.is_finite())
            .fold(0.0, f64::max),
    );
    let y_at = |y: f64| TOP + plot_h - y / y_max * plot_h;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(title)
    );
    for i in 0..=4 {
        let y = y_max * f64::from(i) / 4.0;
        let py = y_at(y);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            py + 4.0,
            thousands(y)
        );
    }
    for &x in xs {
        let px = x_at(x);
        let _ = writeln!(
            svg,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#eee"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{x}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 10.0,
        escape(x_label)
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        escape(y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS.get(i % COLOURS.len()).copied().unwrap_or("black");
        let points: Vec<String> = xs
            .iter()
            .zip(&s.ys)
            .filter(|(_, y)| y.is_finite())
            .map(|(&x, &y)| format!("{:.1},{:.1}", x_at(x), y_at(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        for p in &points {
            let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(
                svg,
                r#"<circle cx="{px}" cy="{py}" r="3" fill="{colour}"/>"#
            );
        }
        let ly = TOP + 10.0 + 18.0 * i as f64;
        let lx = LEFT + plot_w + 12.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The smallest 1, 2 or 5 × 10ⁿ at or above `y` (a round top for the axis).
fn nice_ceiling(y: f64) -> f64 {
    if y <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(y.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&c| c >= y)
        .unwrap_or(10.0 * magnitude)
}

fn thousands(y: f64) -> String {
    let digits = format!("{:.0}", y);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_a_line_and_a_point_per_value_and_skips_missing_ones() {
        let svg = line_chart(
            "t",
            "clients",
            "cycles/s",
            &[1.0, 8.0, 64.0],
            &[
                Series {
                    label: "a<b".into(),
                    ys: vec![1.0, 2.0, 3.0],
                },
                Series {
                    label: "c".into(),
                    ys: vec![1.0, f64::NAN, 5.0],
                },
            ],
        );
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("a&lt;b"));
        assert!(svg.ends_with("</svg>\n"));
    }

    #[test]
    fn the_axis_tops_are_round_and_cover_the_largest_value() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(3.0), 5.0);
        assert_eq!(nice_ceiling(46_506.0), 50_000.0);
        assert_eq!(nice_ceiling(20_000.0), 20_000.0);
        assert_eq!(nice_ceiling(120_000.0), 200_000.0);
        assert_eq!(thousands(46_506.0), "46,506");
        assert_eq!(thousands(500.0), "500");
    }
}
