package charlm

import "math"

// AdamW is Adam with decoupled weight decay (Loshchilov & Hutter).
type AdamW struct {
	Beta1, Beta2, Eps, WeightDecay float32
	m, v                           []float32
	t                              int
}

// NewAdamW returns AdamW for n parameters with the usual language-model
// settings: β = (0.9, 0.95), ε = 1e-8, weight decay 0.1.
func NewAdamW(n int) *AdamW {
	return &AdamW{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1, m: make([]float32, n), v: make([]float32, n)}
}

// Step updates params by grads with learning rate lr.
func (o *AdamW) Step(params, grads []float32, lr float32) {
	o.t++
	c1 := 1 / (1 - float32(math.Pow(float64(o.Beta1), float64(o.t))))
	c2 := 1 / (1 - float32(math.Pow(float64(o.Beta2), float64(o.t))))
	b1, b2 := o.Beta1, o.Beta2
	decay := 1 - lr*o.WeightDecay
	m, v := o.m[:len(params)], o.v[:len(params)]
	for i, g := range grads[:len(params)] {
		mi := b1*m[i] + (1-b1)*g
		vi := b2*v[i] + (1-b2)*g*g
		m[i], v[i] = mi, vi
		params[i] = params[i]*decay - lr*(mi*c1)/(float32(math.Sqrt(float64(vi*c2)))+o.Eps)
	}
}

// Reset forgets the moments (after the parameters were replaced).
func (o *AdamW) Reset() {
	clear(o.m)
	clear(o.v)
	o.t = 0
}

// Schedule is a learning rate with linear warm-up and cosine decay to
// Final×Peak at Total steps (and Final×Peak after).
type Schedule struct {
	Peak   float32
	Warmup int64
	Total  int64
	Final  float32 // fraction of Peak at the end
}

// At returns the learning rate of step t (0-based).
func (s Schedule) At(t int64) float32 {
	if t < s.Warmup {
		return s.Peak * float32(t+1) / float32(s.Warmup)
	}
	if t >= s.Total {
		return s.Peak * s.Final
	}
	p := float64(t-s.Warmup) / float64(max(s.Total-s.Warmup, 1))
	return s.Peak * (s.Final + (1-s.Final)*float32(0.5*(1+math.Cos(math.Pi*p))))
}
