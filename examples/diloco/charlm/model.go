package charlm

import (
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"
)

// Config sizes a model.
type Config struct {
	Context int // characters of context
	Embed   int // embedding width per character
	Hidden  int // hidden units
}

// DefaultConfig is the example's model: 16 characters of context, 16-wide
// embeddings, 256 hidden units (≈ 93 K parameters).
func DefaultConfig() Config { return Config{Context: 16, Embed: 16, Hidden: 256} }

// Validate reports what is wrong with c.
func (c Config) Validate() error {
	if c.Context < 1 || c.Embed < 1 || c.Hidden < 1 {
		return fmt.Errorf("charlm: config %+v: every size must be ≥ 1", c)
	}
	return nil
}

// NumParams is the number of parameters of a model of this size.
func (c Config) NumParams() int {
	in := c.Context * c.Embed
	return Vocab*c.Embed + in*c.Hidden + c.Hidden + c.Hidden*Vocab + Vocab
}

// Model is the network: embeddings, one tanh hidden layer, a softmax over
// the next character. Its fields are views into Params.
type Model struct {
	Config
	Params []float32
	Emb    []float32 // Vocab × Embed
	W1     []float32 // (Context·Embed) × Hidden
	B1     []float32 // Hidden
	W2     []float32 // Hidden × Vocab
	B2     []float32 // Vocab
}

// views cuts p into the model's tensors.
func views(c Config, p []float32) (emb, w1, b1, w2, b2 []float32) {
	in := c.Context * c.Embed
	take := func(n int) []float32 {
		s := p[:n:n]
		p = p[n:]
		return s
	}
	return take(Vocab * c.Embed), take(in * c.Hidden), take(c.Hidden), take(c.Hidden * Vocab), take(Vocab)
}

// New returns a model initialised from seed: the same seed gives the same
// parameters on every machine.
func New(c Config, seed uint64) (*Model, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	m := &Model{Config: c, Params: make([]float32, c.NumParams())}
	m.Emb, m.W1, m.B1, m.W2, m.B2 = views(c, m.Params)
	r := rand.New(rand.NewPCG(seed, 0x636861726c6d))
	fill := func(s []float32, std float64) {
		for i := range s {
			s[i] = float32(r.NormFloat64() * std)
		}
	}
	fill(m.Emb, 1)
	fill(m.W1, 5.0/3/math.Sqrt(float64(c.Context*c.Embed))) // tanh gain
	fill(m.W2, 0.1/math.Sqrt(float64(c.Hidden)))            // near-uniform first predictions
	return m, nil
}

// Trainer computes losses and gradients of a Model; it holds the scratch
// buffers for a batch size.
type Trainer struct {
	m                        *Model
	batch                    int
	Grads                    []float32 // same layout as Model.Params
	gEmb, gW1, gB1, gW2, gB2 []float32
	x, h, logits, dh, dx     []float32
}

// NewTrainer returns a Trainer for batches of up to batch examples.
func NewTrainer(m *Model, batch int) *Trainer {
	t := &Trainer{m: m, batch: batch, Grads: make([]float32, len(m.Params))}
	t.gEmb, t.gW1, t.gB1, t.gW2, t.gB2 = views(m.Config, t.Grads)
	in := m.Context * m.Embed
	t.x = make([]float32, batch*in)
	t.h = make([]float32, batch*m.Hidden)
	t.logits = make([]float32, batch*Vocab)
	t.dh = make([]float32, batch*m.Hidden)
	t.dx = make([]float32, batch*in)
	return t
}

func gemm(ta, tb blas.Transpose, m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32) {
	ar, ac := m, k
	if ta == blas.Trans {
		ar, ac = k, m
	}
	br, bc := k, n
	if tb == blas.Trans {
		br, bc = n, k
	}
	blas32.Gemm(ta, tb, 1,
		blas32.General{Rows: ar, Cols: ac, Stride: lda, Data: a},
		blas32.General{Rows: br, Cols: bc, Stride: ldb, Data: b},
		0, blas32.General{Rows: m, Cols: n, Stride: n, Data: c})
}

// forward fills x, h and the logits (as probabilities if probs) for the
// examples ending at positions pos of tokens (the target of example b is
// tokens[pos[b]], its context the Context tokens before it), and returns
// the summed cross-entropy in nats.
func (t *Trainer) forward(tokens []uint8, pos []int, probs bool) float64 {
	m := t.m
	B, in, H := len(pos), m.Context*m.Embed, m.Hidden
	x, h, logits := t.x[:B*in], t.h[:B*H], t.logits[:B*Vocab]
	for b, p := range pos {
		row := x[b*in : (b+1)*in]
		for k := range m.Context {
			tok := int(tokens[p-m.Context+k])
			copy(row[k*m.Embed:(k+1)*m.Embed], m.Emb[tok*m.Embed:(tok+1)*m.Embed])
		}
	}
	gemm(blas.NoTrans, blas.NoTrans, B, H, in, x, in, m.W1, H, h)
	for b := range B {
		row := h[b*H : (b+1)*H]
		for j := range row {
			row[j] = float32(math.Tanh(float64(row[j] + m.B1[j])))
		}
	}
	gemm(blas.NoTrans, blas.NoTrans, B, Vocab, H, h, H, m.W2, Vocab, logits)
	var loss float64
	for b, p := range pos {
		row := logits[b*Vocab : (b+1)*Vocab]
		mx := float32(math.Inf(-1))
		for j := range row {
			row[j] += m.B2[j]
			mx = max(mx, row[j])
		}
		var sum float64
		for _, v := range row {
			sum += math.Exp(float64(v - mx))
		}
		target := tokens[p]
		loss += math.Log(sum) - float64(row[target]-mx)
		if probs {
			inv := 1 / sum
			for j, v := range row {
				row[j] = float32(math.Exp(float64(v-mx)) * inv)
			}
		}
	}
	return loss
}

// Step computes the mean loss of a batch and its gradient into Grads.
func (t *Trainer) Step(tokens []uint8, pos []int) float32 {
	m := t.m
	B, in, H := len(pos), m.Context*m.Embed, m.Hidden
	loss := t.forward(tokens, pos, true)
	dl := t.logits[:B*Vocab] // probabilities → dLoss/dlogits
	inv := 1 / float32(B)
	for b, p := range pos {
		row := dl[b*Vocab : (b+1)*Vocab]
		row[tokens[p]] -= 1
		for j := range row {
			row[j] *= inv
		}
	}
	h, dh, x, dx := t.h[:B*H], t.dh[:B*H], t.x[:B*in], t.dx[:B*in]
	gemm(blas.Trans, blas.NoTrans, H, Vocab, B, h, H, dl, Vocab, t.gW2)
	clear(t.gB2)
	for b := range B {
		for j, v := range dl[b*Vocab : (b+1)*Vocab] {
			t.gB2[j] += v
		}
	}
	gemm(blas.NoTrans, blas.Trans, B, H, Vocab, dl, Vocab, m.W2, Vocab, dh)
	clear(t.gB1)
	for i, a := range h { // through tanh
		dh[i] *= 1 - a*a
		t.gB1[i%H] += dh[i]
	}
	gemm(blas.Trans, blas.NoTrans, in, H, B, x, in, dh, H, t.gW1)
	gemm(blas.NoTrans, blas.Trans, B, in, H, dh, H, m.W1, H, dx)
	clear(t.gEmb)
	for b, p := range pos {
		row := dx[b*in : (b+1)*in]
		for k := range m.Context {
			tok := int(tokens[p-m.Context+k])
			g := t.gEmb[tok*m.Embed : (tok+1)*m.Embed]
			for e, v := range row[k*m.Embed : (k+1)*m.Embed] {
				g[e] += v
			}
		}
	}
	return float32(loss / float64(B))
}

// Loss is the mean cross-entropy (nats per character) of the model on n
// positions of tokens spread evenly over it, computed in batches with this
// Trainer's buffers.
func (t *Trainer) Loss(tokens []uint8, n int) float64 {
	ctx := t.m.Context
	n = min(n, len(tokens)-ctx)
	stride := float64(len(tokens)-ctx) / float64(n)
	pos := make([]int, 0, t.batch)
	var sum float64
	for i := range n {
		pos = append(pos, ctx+int(float64(i)*stride))
		if len(pos) == t.batch || i == n-1 {
			sum += t.forward(tokens, pos, false)
			pos = pos[:0]
		}
	}
	return sum / float64(n)
}

// Sample fills pos with random training positions of tokens.
func Sample(r *rand.Rand, tokens []uint8, context int, pos []int) {
	for i := range pos {
		pos[i] = context + r.IntN(len(tokens)-context)
	}
}
