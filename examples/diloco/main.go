package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
)

func main() {
	if spec := os.Getenv(replicaEnv); spec != "" {
		var s replicaSpec
		if err := json.Unmarshal([]byte(spec), &s); err != nil {
			fmt.Fprintln(os.Stderr, "diloco replica:", err)
			os.Exit(2)
		}
		os.Exit(runReplica(s))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "diloco:", err)
		}
		os.Exit(1)
	}
}

// run parses args and runs the demo.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := defaultConfig()
	failures := "2@40%:3s"
	fs := flag.NewFlagSet("diloco", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg.flags(fs, &failures)
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.Failures, err = parseFailures(failures, cfg.Replicas); err != nil {
		return err
	}
	if err := cfg.validate(); err != nil {
		return err
	}
	log := zap.NewNop()
	if cfg.Verbose {
		log, _ = zap.NewDevelopment()
	}
	d, err := newDemo(cfg, stdout, log)
	if err != nil {
		return err
	}
	s, err := d.Run(ctx)
	if err != nil {
		return err
	}
	_ = s
	return nil
}
