package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/url"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
)

// newRunConfig is `ftcoord job new-run`: start a new run of a job through
// the API (POST /api/v1/jobs/{job}/runs).
type newRunConfig struct {
	statusConfig // the API's address, token, TLS and timeout; Job
	Run, By      string
}

func (c *newRunConfig) flags(fs *flag.FlagSet) {
	c.statusConfig.flags(fs)
	fs.Lookup("job").Usage = "the `job` (or give it as the argument)"
	fs.StringVar(&c.Run, "run", "", "the new run's `id` (default: a fresh one); trainers with ft.Config.Run empty join it")
	fs.StringVar(&c.By, "by", "ftcoord job new-run", "who starts it, for the record")
}

func (c *newRunConfig) setJob(args []string) error {
	switch {
	case len(args) > 1:
		return fmt.Errorf("unexpected arguments %q: give one job", args[1:])
	case len(args) == 1 && c.Job != "" && c.Job != args[0]:
		return fmt.Errorf("two jobs: -job %q and %q", c.Job, args[0])
	case len(args) == 1:
		c.Job = args[0]
	}
	return nil
}

func (c *newRunConfig) validate() error {
	if c.Job == "" {
		return fmt.Errorf("invalid configuration:\n  which job? ftcoord job new-run [flags] <job>")
	}
	if c.Run != "" && !membership.ValidName(c.Run) {
		return fmt.Errorf("invalid configuration:\n  -run %q: want 1–128 of [A-Za-z0-9._-]", c.Run)
	}
	return c.statusConfig.validate()
}

// newRun starts the run and says what it did.
func newRun(ctx context.Context, c newRunConfig, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	hc, err := c.client()
	if err != nil {
		return err
	}
	var run membership.RunRecord
	if err := c.do(ctx, hc, "POST", "/api/v1/jobs/"+url.PathEscape(c.Job)+"/runs", map[string]string{"run": c.Run, "by": c.By}, &run); err != nil {
		return err
	}
	fmt.Fprintf(w, "job %s: run %s started", c.Job, run.ID)
	if len(run.Ended) > 0 {
		fmt.Fprintf(w, "; run %s ended", run.Ended[0])
	}
	fmt.Fprintf(w, ".\nIts commit records are cleared: trainers started with ft.Config.Run empty (or %q) begin it from step 0.\n", run.ID)
	return nil
}

// setConfig is `ftcoord job set`: change a job's settings through the API
// (POST /api/v1/jobs/{job}/settings).
type setConfig struct {
	statusConfig // the API's address, token, TLS and timeout; Job
	By           string
	Changes      []string
}

func (c *setConfig) flags(fs *flag.FlagSet) {
	c.statusConfig.flags(fs)
	fs.Lookup("job").Usage = "the `job` (or give it as the first argument)"
	fs.StringVar(&c.By, "by", "ftcoord job set", "who sets them, for the record")
}

// setArgs takes the job (unless -job named it) and the changes: key=value,
// key:type=value or -key (unset).
func (c *setConfig) setArgs(args []string) error {
	if c.Job == "" {
		if len(args) == 0 {
			return fmt.Errorf("which job? ftcoord job set [flags] <job> key=value…")
		}
		c.Job, args = args[0], args[1:]
	}
	if len(args) == 0 {
		return fmt.Errorf("no change: give key=value, key:type=value (string, int, float, bool, duration) or -key")
	}
	if _, err := membership.ParseSettingChanges(args); err != nil {
		return err
	}
	c.Changes = args
	return nil
}

func (c *setConfig) validate() error {
	if c.Job == "" {
		return fmt.Errorf("invalid configuration:\n  which job? ftcoord job set [flags] <job> key=value…")
	}
	return c.statusConfig.validate()
}

// setSettings changes the settings and says what is in force, and from
// which epoch.
func setSettings(ctx context.Context, c setConfig, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	hc, err := c.client()
	if err != nil {
		return err
	}
	var up coordinator.SettingsUpdate
	req := map[string]any{"changes": c.Changes, "by": c.By}
	if err := c.do(ctx, hc, "POST", "/api/v1/jobs/"+url.PathEscape(c.Job)+"/settings", req, &up); err != nil {
		return err
	}
	fmt.Fprintf(w, "job %s: settings version %d: %s\n", c.Job, up.Settings.Version, up.Settings.Summary())
	if up.Epoch > 0 {
		fmt.Fprintf(w, "in force from epoch %d: every replica of the epoch uses it from the epoch's first step.\n", up.Epoch)
	} else {
		fmt.Fprintf(w, "%s.\n", up.Pending)
	}
	return nil
}
