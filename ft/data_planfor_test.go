package ft

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// PlanFor, given what a rank's Plan records of the step, returns that
// rank's Plan, and every other rank's as their Samplers would: under both
// policies (configured or set at run time), a target of its own or the
// quorum's, groups of several ranks, steps across an epoch's end.
func TestPlanForIsTheSamplersPlan(t *testing.T) {
	rng := rand.New(rand.NewPCG(44, 1))
	for i := range 300 {
		cfg := SamplerConfig{Size: int64(1 + rng.IntN(300)), Seed: rng.Uint64(), Batch: 1 + rng.IntN(5), Accum: rng.IntN(3),
			Sequential: i%10 == 0}
		if rng.IntN(2) == 0 {
			cfg.Policy = KeepGlobalBatch
		}
		if rng.IntN(3) == 0 {
			cfg.Replicas = 1 + rng.IntN(5)
		}
		var settings Settings
		if rng.IntN(3) == 0 { // the job setting overrides cfg.Policy
			settings = Settings{JobSettings: membership.JobSettings{Values: map[string]membership.Setting{
				SettingBatchPolicy: {Type: membership.SettingString, Value: string(KeepReplicaBatch)}}}}
		}
		groupSize, parts, target := 1+rng.IntN(3), 1+rng.IntN(6), rng.IntN(6)
		step, pos := int64(1+rng.IntN(1000)), rng.Int64N(10*cfg.Size)
		for r := range parts {
			for g := range groupSize {
				c := &Comm{cfg: Config{GroupRank: g, GroupSize: groupSize}}
				s, err := NewSampler(c, cfg)
				if err != nil {
					t.Fatal(err)
				}
				s.state[2] = pos
				s.begin(step, r, parts, target, settings)
				want, err := s.Plan()
				if err != nil {
					t.Fatal(err)
				}
				got, err := PlanFor(cfg, want.Step, want.Position, want.Participants, want.Target, groupSize, want.Policy, r, g)
				if err != nil || !reflect.DeepEqual(got, want) {
					t.Fatalf("case %d (%+v), rank %d.%d of %d: PlanFor %+v, %v; the sampler's %+v", i, cfg, r, g, parts, got, err, want)
				}
			}
		}
	}
}

// PlanFor says what is wrong with its arguments rather than panic.
func TestPlanForRejects(t *testing.T) {
	cfg := SamplerConfig{Size: 100, Batch: 2}
	for _, c := range []struct {
		name string
		cfg  SamplerConfig
		pos  int64
		p, t int
		gs   int
		pol  BatchPolicy
		r, g int
	}{
		{"an invalid config", SamplerConfig{Batch: 2}, 0, 1, 1, 1, "", 0, 0},
		{"no participants", cfg, 0, 0, 1, 1, "", 0, 0},
		{"no target", cfg, 0, 1, 0, 1, "", 0, 0},
		{"no group", cfg, 0, 1, 1, 0, "", 0, 0},
		{"a rank past the participants", cfg, 0, 2, 2, 1, "", 2, 0},
		{"a group rank past the group", cfg, 0, 2, 2, 2, "", 1, 2},
		{"a negative position", cfg, -1, 2, 2, 1, "", 0, 0},
		{"an unknown policy", cfg, 0, 2, 2, 1, "sometimes", 0, 0},
	} {
		if _, err := PlanFor(c.cfg, 1, c.pos, c.p, c.t, c.gs, c.pol, c.r, c.g); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", c.name, err)
		}
	}
}
