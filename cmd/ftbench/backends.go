package main

// The backends ftbench can run (-backend); each registers itself with comm.
import (
	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/backends/nccl"
)

// backendConfig is the comm.Options.BackendConfig of cfg's backend.
func backendConfig(cfg *Config) any {
	if cfg.Backend == "nccl" {
		c := nccl.DefaultConfig()
		if cfg.NCCLMode != "" {
			c.Mode, _ = nccl.ParseMode(cfg.NCCLMode) // Validate checked it
		}
		return &c
	}
	if cfg.Backend == "gloo" && (cfg.GlooLanes != 0 || cfg.GlooSegment != 0) {
		c := gloo.DefaultConfig()
		c.SharedMemoryLanes = cfg.GlooLanes
		if cfg.GlooSegment != 0 {
			c.SegmentSize = int(cfg.GlooSegment)
			c.SharedMemorySegment = int(cfg.GlooSegment)
		}
		return c
	}
	return nil
}
