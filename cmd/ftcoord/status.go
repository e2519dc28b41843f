package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

type statusConfig struct {
	Addr     string
	Job      string
	Token    string
	CACert   string
	Insecure bool
	Timeout  time.Duration
}

func (c *statusConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.Addr, "addr", "http://127.0.0.1:8080", "ftcoord API base `URL`")
	fs.StringVar(&c.Job, "job", "", "show this `job` in detail (default: list jobs)")
	fs.StringVar(&c.Token, "token", "", "bearer `token` (prefer FTCOORD_TOKEN)")
	fs.StringVar(&c.CACert, "cacert", "", "CA `file` to verify an HTTPS ftcoord")
	fs.BoolVar(&c.Insecure, "insecure", false, "do not verify the server's certificate")
	fs.DurationVar(&c.Timeout, "timeout", 10*time.Second, "give up after this long")
}

func (c *statusConfig) validate() error {
	u, err := url.Parse(c.Addr)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("invalid configuration:\n  -addr %q: want http(s)://host:port", c.Addr)
	}
	if c.Job != "" && !membership.ValidName(c.Job) {
		return fmt.Errorf("invalid configuration:\n  -job %q: want 1–128 of [A-Za-z0-9._-]", c.Job)
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("invalid configuration:\n  -timeout %v must be positive", c.Timeout)
	}
	return nil
}

func (c *statusConfig) client() (*http.Client, error) {
	tc := &tls.Config{InsecureSkipVerify: c.Insecure}
	if c.CACert != "" {
		pem, err := os.ReadFile(c.CACert)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("no certificate in %s", c.CACert)
		}
		tc.RootCAs = pool
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: tc}}, nil
}

func (c *statusConfig) get(ctx context.Context, hc *http.Client, path string, out any) error {
	return c.do(ctx, hc, http.MethodGet, path, nil, out)
}

// do sends an API request (in: the JSON body, or nil) and decodes the
// answer into out.
func (c *statusConfig) do(ctx context.Context, hc *http.Client, method, path string, in, out any) error {
	var reqBody io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		reqBody = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(c.Addr, "/")+path, reqBody)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if resp.StatusCode != http.StatusOK {
		var e server.APIError
		if json.Unmarshal(body, &e) == nil && e.Error != "" {
			return fmt.Errorf("%s: %s", resp.Status, e.Error)
		}
		return fmt.Errorf("%s", resp.Status)
	}
	return json.Unmarshal(body, out)
}

// maxSparesNamed bounds the spares a job's status names in its header.
const maxSparesNamed = 16

// status prints the jobs, or one job, as tables.
func status(ctx context.Context, c statusConfig, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	hc, err := c.client()
	if err != nil {
		return err
	}
	var info server.CoordinatorInfo
	if err := c.get(ctx, hc, "/api/v1/coordinator", &info); err != nil {
		return err
	}
	fmt.Fprintf(w, "coordinator %s, leader %s\n\n", info.Name, orNone(info.Leader))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	if c.Job == "" {
		var jobs []coordinator.JobSummary
		if err := c.get(ctx, hc, "/api/v1/jobs", &jobs); err != nil {
			return err
		}
		fmt.Fprintln(tw, "JOB\tEPOCH\tPARTICIPANTS\tMEMBERS\tSINCE")
		for _, j := range jobs {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%s\n", j.Job, j.Epoch, j.Participants, j.Members, since(j.Updated))
		}
		return nil
	}
	var d server.JobDetail
	if err := c.get(ctx, hc, "/api/v1/jobs/"+url.PathEscape(c.Job), &d); err != nil {
		return err
	}
	if q := d.Quorum; q != nil {
		fmt.Fprintf(tw, "epoch %d\t%d participant(s), formed %s: %s\n", q.Epoch, len(q.Participants), since(q.Created), q.Reason)
	} else {
		fmt.Fprintln(tw, "no quorum yet")
	}
	if r := d.Run; r != nil {
		fmt.Fprintf(tw, "run\t%s, started %s by %s\n", r.ID, since(r.Started), r.By)
	}
	if len(d.Members) > 0 {
		fmt.Fprintf(tw, "step\t%d (the highest a member reported; members report with their heartbeats)\n", d.Step)
	}
	if st := d.Settings; st != nil {
		inForce := "not in force yet"
		if q := d.Quorum; q != nil && q.Settings != nil && q.Settings.Version == st.Version {
			inForce = fmt.Sprintf("in force from epoch %d", q.Epoch)
		}
		fmt.Fprintf(tw, "settings\tversion %d (%s, set %s by %s): %s\n", st.Version, inForce, since(st.Updated), st.By, st.Summary())
	}
	if d.Waiting != "" {
		fmt.Fprintf(tw, "waiting\t%s\n", d.Waiting)
	}
	if d.Target > 0 { // the leader's view: a follower's API has none
		fmt.Fprintf(tw, "target\t%d replica group(s), which spares refill the job to\n", d.Target)
		if len(d.Spares) > 0 {
			names := strings.Join(d.Spares[:min(len(d.Spares), maxSparesNamed)], " ")
			if n := len(d.Spares) - maxSparesNamed; n > 0 {
				names += fmt.Sprintf(" and %d more (the table lists them)", n)
			}
			fmt.Fprintf(tw, "spares\t%d waiting, %d ready: %s\n", len(d.Spares), len(d.ReadySpares), names)
		}
	}
	for _, u := range d.UnusableSpares {
		fmt.Fprintf(tw, "spare group %s\tcannot be promoted (%s): %s\n", u.Group, strings.Join(u.Members, " "), u.Reason)
	}
	for _, m := range d.Members {
		if m.WaitingFor > 0 {
			fmt.Fprintf(tw, "%s waits\tfor a holder of step %d: %s\n", m.ID, m.WaitingFor, m.Waiting)
		}
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "MEMBER\tRANK\tSTATE\tHEALTH\tSTEP\tGROUP\tADDR\tINCARNATION")
	spares := map[string]string{} // id → its state
	for _, id := range d.Spares {
		spares[id] = "spare"
	}
	for _, id := range d.ReadySpares {
		spares[id] = "spare (ready)"
	}
	for _, m := range d.Members {
		rank, state := "-", "idle"
		switch {
		case spares[m.ID] != "":
			state = spares[m.ID]
		case m.Spare && d.Target == 0: // no leader's view: the record says
			state = "spare"
		case m.WantQuorum:
			state = "joining"
		}
		if m.Rank >= 0 {
			rank, state = fmt.Sprint(m.Rank), "participant"
			if m.Healing {
				state = "healing"
			}
		}
		if m.WaitingFor > 0 {
			state = "waiting"
		}
		health := m.Health.String()
		if m.HealthReason != "" {
			health += " (" + m.HealthReason + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%d\n", m.ID, rank, state, health, m.Step, m.Group, m.Addr, m.Incarnation)
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func since(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return time.Since(t).Round(time.Second).String() + " ago"
}
