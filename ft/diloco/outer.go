package diloco

// Nesterov is the outer optimizer: SGD with Nesterov momentum, in
// PyTorch's formulation (which the DiLoCo papers use):
//
//	m ← μ·m + g
//	θ ← θ − lr·(g + μ·m)
//
// where g is the outer gradient (global − local parameters, averaged over
// the replicas). It holds no state of its own: the momentum is the
// caller's, so it can be registered for healing.
type Nesterov struct {
	LR, Momentum float32
}

// Apply updates params and momentum in place by grad. The three slices
// have the same length.
func (n Nesterov) Apply(params, momentum, grad []float32) {
	_ = momentum[len(params)-1]
	_ = grad[len(params)-1]
	for i, g := range grad[:len(params)] {
		m := n.Momentum*momentum[i] + g
		momentum[i] = m
		params[i] -= n.LR * (g + n.Momentum*m)
	}
}

// Mix merges a synchronised fragment into the local parameters:
// local = α·local + (1−α)·global.
func Mix(local, global []float32, alpha float32) {
	_ = global[len(local)-1]
	if alpha == 0 {
		copy(local, global)
		return
	}
	for i, g := range global[:len(local)] {
		local[i] = alpha*local[i] + (1-alpha)*g
	}
}

// outerStep is Nesterov.Apply on grad = avg × scale followed by Mix, in
// one pass over the fragment (the same arithmetic, element by element).
func (n Nesterov) outerStep(global, momentum, local, avg []float32, scale, alpha float32) {
	momentum, local, avg = momentum[:len(global)], local[:len(global)], avg[:len(global)]
	for i, p := range global {
		g := avg[i] * scale
		m := n.Momentum*momentum[i] + g
		momentum[i] = m
		p -= n.LR * (g + n.Momentum*m)
		global[i] = p
		local[i] = alpha*local[i] + (1-alpha)*p
	}
}
