package charlm

import (
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func goroot(t testing.TB) string {
	out, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		t.Skipf("go env GOROOT: %v", err)
	}
	return strings.TrimSpace(string(out)) + "/src"
}

func TestTokens(t *testing.T) {
	for b := range 256 {
		tok := Token(byte(b))
		if tok >= Vocab {
			t.Fatalf("byte %d → token %d", b, tok)
		}
		if tok != 0 && Char(tok) != byte(b) {
			t.Fatalf("byte %d → %d → %d", b, tok, Char(tok))
		}
	}
}

// The analytic gradient matches finite differences of the loss.
func TestGradient(t *testing.T) {
	c := Config{Context: 3, Embed: 4, Hidden: 5}
	m, err := New(c, 1)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(3, 4))
	tokens := make([]uint8, 50)
	for i := range tokens {
		tokens[i] = uint8(r.IntN(Vocab))
	}
	pos := []int{3, 10, 20, 49, 10}
	tr := NewTrainer(m, len(pos))
	tr.Step(tokens, pos)
	grads := append([]float32(nil), tr.Grads...)
	loss := func() float64 { return tr.forward(tokens, pos, false) / float64(len(pos)) }
	checked := 0
	for i := 0; i < len(m.Params); i += 7 {
		old := m.Params[i]
		const eps = 1e-2
		m.Params[i] = old + eps
		up := loss()
		m.Params[i] = old - eps
		down := loss()
		m.Params[i] = old
		num := (up - down) / (2 * eps)
		if math.Abs(num-float64(grads[i])) > 2e-3+0.02*math.Abs(num) {
			t.Errorf("param %d: analytic %v, numeric %v", i, grads[i], num)
		}
		checked++
	}
	if checked < 100 {
		t.Fatalf("checked only %d", checked)
	}
}

func TestScheduleShape(t *testing.T) {
	s := Schedule{Peak: 1, Warmup: 10, Total: 110, Final: 0.1}
	if s.At(0) != 0.1 || s.At(9) != 1 || s.At(10) != 1 || math.Abs(float64(s.At(60))-0.55) > 1e-6 || s.At(200) != 0.1 {
		t.Fatalf("%v %v %v %v %v", s.At(0), s.At(9), s.At(10), s.At(60), s.At(200))
	}
}

// A few hundred AdamW steps on Go source bring the validation loss well
// below the uniform guess (ln 98 ≈ 4.58 nats).
func TestLearnsGoSource(t *testing.T) {
	corpus, err := LoadGoSource(goroot(t), 1<<20, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := New(DefaultConfig(), 1)
	tr := NewTrainer(m, 64)
	opt := NewAdamW(len(m.Params))
	r := rand.New(rand.NewPCG(1, 1))
	pos := make([]int, 64)
	before := tr.Loss(corpus.Val, 2048)
	steps := 300
	if testing.Short() {
		steps = 100
	}
	for range steps {
		Sample(r, corpus.Train, m.Context, pos)
		tr.Step(corpus.Train, pos)
		opt.Step(m.Params, tr.Grads, 3e-3)
	}
	after := tr.Loss(corpus.Val, 2048)
	t.Logf("validation loss %.3f → %.3f after %d steps", before, after, steps)
	if before < 4 || after > 3.2 {
		t.Fatalf("validation loss %.3f → %.3f", before, after)
	}
	if os.Getenv("CHARLM_LONG") != "" {
		t.Log("long run")
	}
}
