package charlm

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/ftcomm/ftcomm/ft/diloco"
)

func TestScratchDiLoCo(t *testing.T) {
	if os.Getenv("SCRATCH2") == "" {
		t.Skip()
	}
	atoi := func(k string, d int) int {
		if v, err := strconv.Atoi(os.Getenv(k)); err == nil {
			return v
		}
		return d
	}
	H, F, tau := atoi("H", 100), atoi("F", 4), atoi("TAU", 1)
	alpha := float32(atoi("ALPHA", 50)) / 100
	olr := float32(atoi("OLR", 70)) / 100
	T := atoi("T", 2000)
	R := atoi("R", 4)
	lr := float32(atoi("LR", 30)) / 1e4
	corpus, _ := LoadGoSource(goroot(t), 4<<20, 256<<10)
	type rep struct {
		m   *Model
		tr  *Trainer
		opt *AdamW
		r   *rand.Rand
	}
	var reps []rep
	for i := range R {
		m, _ := New(DefaultConfig(), 1)
		reps = append(reps, rep{m, NewTrainer(m, 64), NewAdamW(len(m.Params)), rand.New(rand.NewPCG(1, uint64(i)))})
	}
	global := append([]float32(nil), reps[0].m.Params...)
	mom := make([]float32, len(global))
	n := len(global)
	every := H / F
	sched := Schedule{Peak: lr, Warmup: 100, Total: int64(T), Final: 0.1}
	pos := make([]int, 64)
	nest := diloco.Nesterov{LR: olr, Momentum: 0.9}
	frag := 0
	var pend [][]float32
	pf := -1
	ev := NewTrainer(reps[0].m, 256)
	evm, _ := New(DefaultConfig(), 1)
	ev = NewTrainer(evm, 256)
	for step := 0; step < T; step++ {
		if pf >= 0 && step%every == tau {
			lo, hi := pf*n/F, (pf+1)*n/F
			avg := make([]float32, hi-lo)
			for _, d := range pend {
				for i := range avg {
					avg[i] += d[i] / float32(R)
				}
			}
			nest.Apply(global[lo:hi], mom[lo:hi], avg)
			for _, r := range reps {
				diloco.Mix(r.m.Params[lo:hi], global[lo:hi], alpha)
			}
			pf = -1
		}
		if step > 0 && step%every == 0 {
			lo, hi := frag*n/F, (frag+1)*n/F
			pend = pend[:0]
			for _, r := range reps {
				d := make([]float32, hi-lo)
				for i := range d {
					d[i] = global[lo+i] - r.m.Params[lo+i]
				}
				pend = append(pend, d)
			}
			pf = frag
			frag = (frag + 1) % F
			if tau == 0 {
				step-- // apply now
				continue
			}
		}
		for _, r := range reps {
			Sample(r.r, corpus.Train, r.m.Context, pos)
			r.tr.Step(corpus.Train, pos)
			r.opt.Step(r.m.Params, r.tr.Grads, sched.At(int64(step)))
		}
		if (step+1)%500 == 0 {
			copy(evm.Params, global)
			t.Logf("H=%d F=%d τ=%d α=%.2f olr=%.2f lr=%.4f step %d global val %.3f", H, F, tau, alpha, olr, lr, step+1, ev.Loss(corpus.Val, 8192))
		}
	}
}
