package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

var faultColors = map[FaultKind]color.NRGBA{
	FaultKill:      {R: 214, G: 39, B: 40, A: 70},
	FaultStop:      {R: 255, G: 127, B: 14, A: 70},
	FaultCoordKill: {R: 148, G: 103, B: 189, A: 70},
	FaultCoordTerm: {R: 197, G: 176, B: 213, A: 90},
	FaultCoordAll:  {R: 140, G: 86, B: 75, A: 70},
	FaultEtcd:      {R: 227, G: 119, B: 194, A: 70},
	FaultPartition: {R: 31, G: 119, B: 180, A: 70},
	FaultIsolate:   {R: 23, G: 190, B: 207, A: 70},
	FaultSlow:      {R: 188, G: 189, B: 34, A: 70},
	FaultCut:       {R: 44, G: 160, B: 44, A: 70},
	FaultStall:     {R: 127, G: 127, B: 127, A: 70},
	FaultStarve:    {R: 255, G: 187, B: 120, A: 90},
}

// plotTimeline draws the run in three rows sharing the time axis: the
// job's committed steps per second, the participants of the newest
// commits, and the epoch; every fault is a shaded span of its kind's
// colour.
func plotTimeline(path string, r *Report, evs []Event, faults []*Fault) error {
	origin := r.Started
	sec := func(t int64) float64 { return time.Unix(0, t).Sub(origin).Seconds() }
	end := 0.0
	if len(evs) > 0 {
		end = sec(evs[len(evs)-1].T)
	}
	// One-second bins; a long run (a soak) gets about 300 bins.
	bin := max(1, math.Round(end/300))
	nb := int(end/bin) + 1
	maxStep := make([]int64, nb)
	parts := make([]float64, nb)
	epochs := make([]float64, nb)
	for _, e := range evs {
		if e.Kind != evCommit {
			continue
		}
		i := min(int(sec(e.T)/bin), nb-1)
		if i < 0 {
			continue
		}
		maxStep[i] = max(maxStep[i], e.Step)
		if float64(e.Epoch) >= epochs[i] {
			epochs[i] = float64(e.Epoch)
			parts[i] = float64(e.N)
		}
	}
	var rate, part, epoch plotter.XYs
	var prevStep int64
	var prevPart, prevEpoch float64
	for i := range nb {
		x := float64(i) * bin
		s := max(maxStep[i], prevStep)
		rate = append(rate, plotter.XY{X: x, Y: float64(s-prevStep) / bin})
		prevStep = s
		if epochs[i] > 0 {
			prevPart, prevEpoch = parts[i], epochs[i]
		}
		part = append(part, plotter.XY{X: x, Y: prevPart})
		epoch = append(epoch, plotter.XY{X: x, Y: prevEpoch})
	}
	row := func(title, ylabel string, xys plotter.XYs, c color.Color, stepped bool) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text = title
		p.Y.Label.Text = ylabel
		p.X.Min, p.X.Max = 0, end
		ymax := 1.0
		for _, xy := range xys {
			ymax = max(ymax, xy.Y)
		}
		p.Y.Min, p.Y.Max = 0, ymax*1.1
		for _, f := range faults {
			x0, x1 := f.Start.Sub(origin).Seconds(), f.End.Sub(origin).Seconds()
			if f.End.IsZero() || x1-x0 < 0.3 {
				x1 = x0 + 0.3
			}
			poly, err := plotter.NewPolygon(plotter.XYs{{X: x0, Y: 0}, {X: x1, Y: 0}, {X: x1, Y: p.Y.Max}, {X: x0, Y: p.Y.Max}})
			if err != nil {
				return nil, err
			}
			poly.Color, poly.LineStyle.Width = faultColors[f.Kind], 0
			p.Add(poly)
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return nil, err
		}
		l.Color, l.Width = c, vg.Points(1)
		if stepped {
			l.StepStyle = plotter.PostStep
		}
		p.Add(l)
		return p, nil
	}
	s := r.Settings
	top, err := row(fmt.Sprintf("chaos: %d replicas, %s, %s network, durable %v — %d faults, efficiency %.1f%%, %d violations",
		s.Replicas, s.Topology, r.Network, s.Durable, r.Faults, 100*r.Efficiency, len(r.Violations)),
		"committed steps/s", rate, color.RGBA{B: 160, A: 255}, false)
	if err != nil {
		return err
	}
	seen := map[FaultKind]bool{}
	for _, f := range faults {
		if seen[f.Kind] {
			continue
		}
		seen[f.Kind] = true
		poly, err := plotter.NewPolygon(plotter.XYs{{X: 0, Y: 0}, {X: 0, Y: 0}, {X: 0, Y: 0}})
		if err != nil {
			return err
		}
		poly.Color, poly.LineStyle.Width = faultColors[f.Kind], 0
		top.Legend.Add(string(f.Kind), poly)
	}
	top.Legend.Top, top.Legend.Left = true, false
	top.Legend.TextStyle.Font.Size = vg.Points(8)
	mid, err := row("", "participants", part, color.RGBA{G: 120, A: 255}, true)
	if err != nil {
		return err
	}
	bot, err := row("", "epoch", epoch, color.Black, true)
	if err != nil {
		return err
	}
	bot.X.Label.Text = "seconds since the replicas started"
	const w, h = 11 * vg.Inch, 7 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	t := draw.Tiles{Rows: 3, Cols: 1, PadX: vg.Millimeter, PadY: vg.Millimeter, PadTop: vg.Points(2), PadBottom: vg.Points(2),
		PadLeft: vg.Points(2), PadRight: vg.Points(2)}
	plots := [][]*plot.Plot{{top}, {mid}, {bot}}
	canvases := plot.Align(plots, t, dc)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = vgimg.PngCanvas{Canvas: img}.WriteTo(f)
	return err
}
