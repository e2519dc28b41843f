package main

import (
	"fmt"
	"image/color"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// plot draws the validation loss of each job's global parameters against
// the committed syncs, with the kills and rejoins marked, into a PNG.
func (d *demo) plot(path string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Streaming DiLoCo on ft.Comm: %d replicas, H=%d F=%d τ=%d α=%g, %s", d.cfg.Replicas, d.cfg.H, d.cfg.F, d.cfg.Tau, d.cfg.Alpha, d.cfg.Quant)
	p.X.Label.Text = "committed syncs"
	p.Y.Label.Text = "validation loss (nats/char)"
	p.Add(plotter.NewGrid())
	lo, hi := math.Inf(1), math.Inf(-1)
	colors := []color.Color{color.RGBA{R: 214, G: 39, B: 40, A: 255}, color.RGBA{R: 31, G: 119, B: 180, A: 255}}
	for i, j := range d.jobs {
		pts := make(plotter.XYs, 0, len(j.curve)+1)
		for _, c := range j.curve {
			pts = append(pts, plotter.XY{X: float64(c.Step), Y: c.Loss})
			lo, hi = min(lo, c.Loss), max(hi, c.Loss)
		}
		if len(pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		l.Color, l.Width = colors[i%len(colors)], vg.Points(1.5)
		if i == 1 {
			l.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
		}
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("%s (final %.3f)", j.name, j.finalLoss), l)
	}
	if math.IsInf(lo, 0) {
		lo, hi = 0, 1
	}
	// The first syncs fall steeply from ln 98; show the part where the runs
	// can differ: from the loss a tenth into the run down.
	top := hi
	for _, j := range d.jobs {
		for _, c := range j.curve {
			if c.Step >= d.cfg.Syncs()/10 {
				top = min(top, c.Loss)
				break
			}
		}
	}
	if top > lo {
		hi = top + 0.1*(top-lo)
	}
	p.Y.Min, p.Y.Max = lo-0.02*(hi-lo), hi
	marker := func(x float64, c color.Color, dashes []vg.Length, label string) error {
		l, err := plotter.NewLine(plotter.XYs{{X: x, Y: lo}, {X: x, Y: hi}})
		if err != nil {
			return err
		}
		l.Color, l.Dashes, l.Width = c, dashes, vg.Points(1)
		p.Add(l)
		p.Legend.Add(label, l)
		return nil
	}
	for _, j := range d.jobs {
		for _, k := range j.kills {
			if err := marker(float64(k.KilledStep), color.Black, []vg.Length{vg.Points(2), vg.Points(2)}, fmt.Sprintf("r%d killed (sync %d)", k.Replica, k.KilledStep)); err != nil {
				return err
			}
			if k.PromotedStep > 0 {
				if err := marker(float64(k.PromotedStep), color.RGBA{R: 148, G: 103, B: 189, A: 255}, []vg.Length{vg.Points(4), vg.Points(2)}, fmt.Sprintf("%s promoted in r%d's place (sync %d)", k.Promoted, k.Replica, k.PromotedStep)); err != nil {
					return err
				}
			}
			if k.Rejoined > 0 {
				if err := marker(float64(k.RejoinedStep), color.RGBA{G: 150, A: 255}, nil, fmt.Sprintf("r%d healed and rejoined (sync %d)", k.Replica, k.RejoinedStep)); err != nil {
					return err
				}
			}
		}
	}
	p.Legend.Top, p.Legend.Left = true, false
	p.Legend.XOffs, p.Legend.YOffs = -vg.Points(5), -vg.Points(5)
	p.Legend.TextStyle.Font.Size = vg.Points(9)
	p.Title.TextStyle.Font.Size = vg.Points(11)
	p.Title.Padding = vg.Points(8)
	return p.Save(9*vg.Inch, 5*vg.Inch, path)
}
