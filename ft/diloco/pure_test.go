package diloco

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

func TestNesterovMatchesTheFormula(t *testing.T) {
	// Two steps by hand: m1 = g1, θ1 = θ0 − lr(g1 + μ g1);
	// m2 = μ m1 + g2, θ2 = θ1 − lr(g2 + μ m2).
	n := Nesterov{LR: 0.7, Momentum: 0.9}
	params, mom := []float32{1, -2}, []float32{0, 0}
	g1, g2 := []float32{0.5, -1}, []float32{0.25, 0}
	n.Apply(params, mom, g1)
	n.Apply(params, mom, g2)
	for i := range params {
		m1 := float64(g1[i])
		th1 := []float64{1, -2}[i] - 0.7*(float64(g1[i])+0.9*m1)
		m2 := 0.9*m1 + float64(g2[i])
		th2 := th1 - 0.7*(float64(g2[i])+0.9*m2)
		if math.Abs(float64(params[i])-th2) > 1e-6 || math.Abs(float64(mom[i])-m2) > 1e-6 {
			t.Errorf("element %d: θ %v m %v, want %v %v", i, params[i], mom[i], th2, m2)
		}
	}
}

func TestNesterovWithoutMomentumIsSGD(t *testing.T) {
	n := Nesterov{LR: 0.5}
	params, mom := []float32{3}, []float32{0}
	n.Apply(params, mom, []float32{2}) // θ − lr·g
	if params[0] != 2 {
		t.Fatalf("θ = %v, want 2", params[0])
	}
}

// With outer lr 1 and no momentum, DiLoCo's outer step lands on the
// average of the replicas' local parameters (global − avg(global − local)).
func TestOuterStepWithLR1IsAveraging(t *testing.T) {
	global := []float32{1, 1}
	locals := [][]float32{{0, 2}, {2, 4}}
	avg := make([]float32, 2)
	for _, l := range locals {
		for i := range avg {
			avg[i] += (global[i] - l[i]) / 2
		}
	}
	Nesterov{LR: 1}.Apply(global, make([]float32, 2), avg)
	if global[0] != 1 || global[1] != 3 {
		t.Fatalf("global %v, want [1 3]", global)
	}
}

func TestMix(t *testing.T) {
	for _, tc := range []struct {
		alpha float32
		want  float32
	}{{0, 10}, {1, 2}, {0.5, 6}, {0.25, 8}} {
		local := []float32{2}
		Mix(local, []float32{10}, tc.alpha)
		if local[0] != tc.want {
			t.Errorf("α = %v: %v, want %v", tc.alpha, local[0], tc.want)
		}
	}
}

func TestSplit(t *testing.T) {
	for _, tc := range []struct {
		n, f, align int
		want        []span
	}{
		{1000, 4, 128, []span{{0, 256}, {256, 512}, {512, 768}, {768, 1000}}},
		{1000, 1, 128, []span{{0, 1000}}},
		{10, 3, 128, []span{{0, 3}, {3, 6}, {6, 10}}}, // too small to align
		{1024, 3, 128, []span{{0, 256}, {256, 640}, {640, 1024}}},
		{4, 4, 2, []span{{0, 1}, {1, 2}, {2, 3}, {3, 4}}},
	} {
		got := split(tc.n, tc.f, tc.align)
		if len(got) != len(tc.want) {
			t.Fatalf("split(%d, %d, %d) = %v", tc.n, tc.f, tc.align, got)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("split(%d, %d, %d) = %v, want %v", tc.n, tc.f, tc.align, got, tc.want)
				break
			}
		}
	}
}

// The schedule as a table: which inner step starts a sync, which fragment
// it carries, and where it is merged.
func TestSchedule(t *testing.T) {
	// H = 8, F = 4: a sync every 2 inner steps; τ = 1.
	s := Schedule{Every: 2, Overlap: 1}
	var trace []string
	started, step := -1, int64(0)
	for done := 0; done <= 8; done++ {
		if started >= 0 && s.FinishesAt(started, done) {
			trace = append(trace, "merge")
			started = -1
			step++ // every sync commits here
		}
		if started < 0 && s.StartsAt(done) {
			trace = append(trace, "send"+string(rune('0'+Fragment(step, 4))))
			started = done
		}
		trace = append(trace, "inner")
	}
	got := strings.Join(trace, " ")
	want := "send0 inner merge inner send1 inner merge inner send2 inner merge inner send3 inner merge inner send0 inner"
	if got != want {
		t.Fatalf("schedule\n got %s\nwant %s", got, want)
	}
	// τ = 0 merges at once.
	if !(Schedule{Every: 4}).FinishesAt(8, 8) {
		t.Fatal("τ = 0 does not finish at the start")
	}
	// A failed sync (no new committed step) retries the same fragment.
	if Fragment(5, 4) != 1 || Fragment(5, 4) != Fragment(5, 4) || Fragment(6, 4) != 2 {
		t.Fatal("fragment round robin")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		mut  func(*Config)
		want string
	}{
		{func(c *Config) {}, ""},
		{func(c *Config) { *c = DefaultStreamingConfig() }, ""},
		{func(c *Config) { c.InnerSteps, c.Fragments = 10, 4 }, "not divisible"},
		{func(c *Config) { c.InnerSteps = 0 }, "H = 0"},
		{func(c *Config) { c.Fragments = 0 }, "F = 0"},
		{func(c *Config) { c.Fragments, c.Overlap = 4, 25 }, "τ = 25"},
		{func(c *Config) { c.Fragments, c.Overlap = 4, 24 }, ""},
		{func(c *Config) { c.Overlap = -1 }, "τ = -1"},
		{func(c *Config) { c.Alpha = 1.5 }, "α = 1.5"},
		{func(c *Config) { c.Alpha = -0.1 }, "α = -0.1"},
		{func(c *Config) { c.Alpha = math.NaN() }, "α = NaN"},
		{func(c *Config) { c.Alpha = 1 }, ""},
		{func(c *Config) { c.OuterLR = 0 }, "learning rate"},
		{func(c *Config) { c.OuterMomentum = 1 }, "momentum"},
		{func(c *Config) { c.Quantization = 7 }, "quantization"},
		{func(c *Config) { c.QuantBlock = 3 }, "block"},
		{func(c *Config) { c.QuantBlock = 0 }, ""},
	} {
		c := DefaultConfig()
		tc.mut(&c)
		err := c.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: unexpected %v", c, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, comm.ErrInvalidArgument)):
			t.Errorf("%+v: got %v, want an ErrInvalidArgument mentioning %q", c, err, tc.want)
		}
	}
}

func TestParseQuantization(t *testing.T) {
	for s, want := range map[string]Quantization{"": Float32, "float32": Float32, "int8": Int8, "4": Int4, "int4": Int4} {
		if q, err := ParseQuantization(s); err != nil || q != want {
			t.Errorf("%q: %v %v", s, q, err)
		}
	}
	if _, err := ParseQuantization("int3"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("int3: %v", err)
	}
}

func randVec(r *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64() * scale)
	}
	return v
}

// Every value comes back within half a quantization step of its block
// (absmax/2L), a block's largest magnitude exactly, and the receivers'
// decoding equals what the sender says they will see.
func TestQuantizeRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, q := range []Quantization{Int8, Int4} {
		for _, n := range []int{1, 7, 128, 300, 1000} {
			for _, block := range []int{2, 64, 128} {
				v := randVec(r, n, 3)
				v[n/2] = 0
				p := make([]byte, payloadSize(n, q, block))
				out := make([]float32, n)
				encode(p, v, out, 0.5, q, block)
				if w := payloadWeight(p); w != 0.5 {
					t.Fatalf("weight %v", w)
				}
				got := make([]float32, n)
				decodeAdd(got, p, 1, q, block)
				for lo := 0; lo < n; lo += block {
					hi := min(lo+block, n)
					var absmax float64
					for _, x := range v[lo:hi] {
						absmax = max(absmax, math.Abs(float64(x)))
					}
					bound := absmax/(2*float64(q.levels()))*(1+1e-6) + 1e-12
					for i := lo; i < hi; i++ {
						if got[i] != out[i] {
							t.Fatalf("%v n=%d block=%d: decoded %v, sender expected %v", q, n, block, got[i], out[i])
						}
						if e := math.Abs(float64(got[i] - v[i])); e > bound {
							t.Fatalf("%v n=%d block=%d: |%v − %v| = %v > %v", q, n, block, got[i], v[i], e, bound)
						}
						if math.Abs(float64(v[i])) == absmax && math.Abs(float64(got[i]-v[i])) > absmax*1e-6 {
							t.Fatalf("%v: block max %v came back as %v", q, v[i], got[i])
						}
					}
				}
			}
		}
	}
}

// Error feedback: quantizing the same small signal again and again with
// the residual carried over, the decoded sum tracks the true sum to within
// one step, where without feedback the bias grows with every round.
func TestErrorFeedbackBoundsTheAccumulatedError(t *testing.T) {
	const n, rounds, block = 128, 200, 128
	v := make([]float32, n)
	for i := range v {
		v[i] = 0.01 * float32(i%5) // small values next to one large one
	}
	v[0] = 1
	res := make([]float32, n)
	sent := make([]float32, n)
	in := make([]float32, n)
	p := make([]byte, payloadSize(n, Int4, block))
	sumTrue, sumEF, sumNoEF := make([]float64, n), make([]float64, n), make([]float64, n)
	plain := make([]float32, n)
	for range rounds {
		for i := range in {
			in[i] = v[i] + res[i]
		}
		encode(p, in, sent, 1, Int4, block)
		for i := range res {
			res[i] = in[i] - sent[i]
			sumTrue[i] += float64(v[i])
			sumEF[i] += float64(sent[i])
		}
		encode(p, v, plain, 1, Int4, block)
		for i := range plain {
			sumNoEF[i] += float64(plain[i])
		}
	}
	step := 1.0 / 7 // the block's scale: absmax 1 over 7 levels
	var worstEF, worstNoEF float64
	for i := range sumTrue {
		worstEF = max(worstEF, math.Abs(sumEF[i]-sumTrue[i]))
		worstNoEF = max(worstNoEF, math.Abs(sumNoEF[i]-sumTrue[i]))
	}
	if worstEF > step {
		t.Errorf("with error feedback the accumulated error is %v, want ≤ one step %v", worstEF, step)
	}
	if worstNoEF < 10*step {
		t.Errorf("without error feedback the accumulated error is only %v: the test does not exercise feedback", worstNoEF)
	}
}

func TestQuantizeNaNAndZeros(t *testing.T) {
	v := []float32{float32(math.NaN()), 1, 0, 0}
	p := make([]byte, payloadSize(4, Int4, 2))
	out := make([]float32, 4)
	encode(p, v, out, 1, Int4, 2)
	if out[0] != 0 || out[1] != 1 || out[2] != 0 || out[3] != 0 {
		t.Fatalf("decoded %v", out)
	}
}

// The bytes a payload takes: 4-bit codes with a float32 scale per 128
// values are 4.25 bits a value, under 1/7 of float32.
func TestPayloadSize(t *testing.T) {
	const n = 1 << 16
	f32 := 4 * n
	for _, tc := range []struct {
		q    Quantization
		want float64
	}{{Int8, 8.25 / 32}, {Int4, 4.25 / 32}} {
		got := float64(payloadSize(n, tc.q, 128)) / float64(f32)
		if math.Abs(got-tc.want) > 1e-4 {
			t.Errorf("%v: %v of float32, want %v", tc.q, got, tc.want)
		}
	}
	if r := float64(payloadSize(n, Int4, 128)) / float64(f32); r > 1.0/7 {
		t.Errorf("int4 payload is %v of float32, over 1/7", r)
	}
}

func TestWireBytes(t *testing.T) {
	const mb = 1 << 20
	for _, tc := range []struct {
		got, want int64
	}{
		{allReduceWire(4, mb), 2 * 3 * mb / 4},
		{allReduceWire(1, mb), 0},
		{allReduceWire(4, 1024), 2 * 1024},              // recursive doubling, 2 rounds
		{allReduceWire(3, 1024), (2*1024 + 2*1024) / 3}, // one extra rank folded in
		{allGatherWire(4, 100), 300},
		{allToAllWire(4, 100), 300},
	} {
		if tc.got != tc.want {
			t.Errorf("got %d, want %d", tc.got, tc.want)
		}
	}
}

// The fused outer step is Nesterov.Apply then Mix.
func TestOuterStepIsApplyThenMix(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const n = 257
	g1, m1, l1 := randVec(r, n, 1), randVec(r, n, 1), randVec(r, n, 1)
	sum := randVec(r, n, 3)
	g2, m2, l2 := append([]float32(nil), g1...), append([]float32(nil), m1...), append([]float32(nil), l1...)
	o := Nesterov{LR: 0.7, Momentum: 0.9}
	scale := float32(1) / 3
	avg := make([]float32, n)
	for i := range avg {
		avg[i] = sum[i] * scale
	}
	o.Apply(g1, m1, avg)
	Mix(l1, g1, 0.5)
	o.outerStep(g2, m2, l2, sum, scale, 0.5)
	for i := range g1 {
		close := func(a, b float32) bool { return math.Abs(float64(a-b)) <= 1e-6*(1+math.Abs(float64(a))) } // FMA may fuse differently
		if !close(g1[i], g2[i]) || !close(m1[i], m2[i]) || !close(l1[i], l2[i]) {
			t.Fatalf("element %d: %v %v %v, fused %v %v %v", i, g1[i], m1[i], l1[i], g2[i], m2[i], l2[i])
		}
	}
}

// A period that changed at a sync counts from that sync's start.
func TestScheduleFrom(t *testing.T) {
	s := Schedule{Every: 3, From: 4}
	var starts []int
	for done := 0; done <= 12; done++ {
		if s.StartsAt(done) {
			starts = append(starts, done)
		}
	}
	if fmt.Sprint(starts) != "[4 7 10]" {
		t.Fatalf("starts %v, want [4 7 10]", starts)
	}
}

// soloComm is a replica alone (every step commits), enough to drive
// DiLoCo's schedule.
type soloComm struct{ step int64 }

func (c *soloComm) Register(string, comm.Tensor) error { return nil }
func (c *soloComm) Step(context.Context) error         { return nil }
func (c *soloComm) AllReduce(context.Context, comm.Tensor, comm.ReduceOp) *comm.Work {
	return comm.FailedWork(nil)
}
func (c *soloComm) AllGather(context.Context, comm.Tensor, comm.Tensor) *comm.Work {
	return comm.FailedWork(nil)
}
func (c *soloComm) Commit(context.Context) (bool, error) { c.step++; return true, nil }
func (c *soloComm) CommittedStep() int64                 { return c.step }
func (c *soloComm) Epoch() uint64                        { return 1 }
func (c *soloComm) Participants() int                    { return 1 }
func (c *soloComm) Rank() int                            { return 0 }

// Retune changes the sync period from the sync that started last, keeps
// InnerStep counting on, and refuses a period the fragments do not divide.
func TestRetune(t *testing.T) {
	cfg := DefaultConfig()
	cfg.InnerSteps = 4
	d, err := New(&soloComm{}, make([]float32, 8), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var syncs []int64
	for i := 0; i < 20; i++ {
		o, err := d.Tick(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if o.Synced {
			syncs = append(syncs, d.InnerStep())
			if len(syncs) == 3 { // retune at the third sync: every 2 from there
				if err := d.Retune(0.5, 2); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if fmt.Sprint(syncs) != "[1 5 9 11 13 15 17 19]" { // counted after the sync's own inner step
		t.Fatalf("inner steps at the syncs %v", syncs)
	}
	cfg.Fragments = 2
	d2, err := New(&soloComm{}, make([]float32, 8), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Retune(0, 3); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("a period the fragments do not divide: %v", err)
	}
	if err := d.Retune(-1, 0); err != nil {
		t.Fatalf("nothing to change: %v", err)
	}
}
