package gloo

import (
	"context"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

func TestSmokeAllReduce(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4} {
		for _, algo := range []Algorithm{AlgorithmRing, AlgorithmRecursiveDoubling} {
			j := newJob(t, n, func(c *Config) { c.Algorithm = algo })
			j.mustRun(func(r int, c *comm.Comm) error {
				x := make([]float32, 1000)
				for i := range x {
					x[i] = float32(r + i)
				}
				if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
					return err
				}
				for i := range x {
					want := float32(n*i + n*(n-1)/2)
					if x[i] != want {
						t.Errorf("n=%d %s rank %d: x[%d] = %v, want %v", n, algo, r, i, x[i], want)
						break
					}
				}
				return nil
			})
			j.close()
		}
	}
}
