package server

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// browser starts headless Chromium for one test, or skips the test when
// it is not installed.
func browser(t *testing.T) context.Context {
	t.Helper()
	path := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		t.Skip("chromium is not installed (Debian: apt-get install -y chromium); skipping the dashboard test")
	}
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancelCtx()
		cancelAlloc()
	})
	// Start the browser now. Its first call must not carry a timeout (the
	// browser lives as long as that call's ctx), so bound it from outside.
	watchdog := time.AfterFunc(60*time.Second, cancelCtx)
	defer watchdog.Stop()
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	return ctx
}

func TestDashboardInChromium(t *testing.T) {
	ctx := browser(t)
	lc := startLiveCoordinator(t, "", false)
	run := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := chromedp.Do(rctx, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	text := func(sel string) string {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		s, err := chromedp.Run(rctx, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("text of %s: %v", sel, err)
		}
		return s
	}
	run("load the page", chromedp.Navigate(lc.srv.URL+"/?job=llama"), chromedp.WaitVisible(chromedp.CSS("#joblist")))

	// Members appear on the live page as they join.
	a, b := lc.join(t, "llama", "a"), lc.join(t, "llama", "b")
	a.SetStep(12)
	if err := a.Heartbeat(testutil.Ctx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	run("see the members", chromedp.WaitVisible(chromedp.CSS(`tr[data-member="a"]`)), chromedp.WaitVisible(chromedp.CSS(`tr[data-member="b"]`)))
	run("see the timeline", chromedp.WaitVisible(chromedp.CSS(`#timeline li[data-epoch]`)))
	epoch, rowA := text("#epoch"), text(`tr[data-member="a"]`)
	if !strings.HasPrefix(epoch, "epoch ") || !strings.Contains(rowA, "healthy") {
		t.Fatalf("epoch %q, row a %q", epoch, rowA)
	}

	// A spare shows as one, ready, and the job's target and spares above.
	lc.joinWith(t, "llama", "s", func(c *membership.MemberConfig) { c.Spare = true })
	run("see the spare",
		chromedp.WaitVisible(chromedp.Search(`//tr[@data-member="s"]/td/span[contains(., "spare (ready)")]`)),
		chromedp.WaitVisible(chromedp.Search(`//div[@id="spares"][contains(., "target 2 replica group(s) · 1 spare(s) waiting, 1 ready")]`)))

	// Evict b with its button: b learns it, and the page drops it.
	run("click evict", chromedp.Click(chromedp.CSS(`button.evict[data-member="b"]`)))
	select {
	case <-b.Done():
	case <-testutil.Ctx(t, 20*time.Second).Done():
		t.Fatal("b was not evicted")
	}
	run("see b go",
		chromedp.WaitNotPresent(chromedp.CSS(`tr[data-member="b"]`)),
		chromedp.WaitVisible(chromedp.CSS(`tr[data-member="a"]`)),
		// The timeline says why the epoch changed.
		chromedp.WaitVisible(chromedp.Search(`//ul[@id="timeline"]/li[contains(., "b evicted by dashboard")]`)))
}

func TestDashboardAsksForToken(t *testing.T) {
	ctx := browser(t)
	lc := startLiveCoordinator(t, "s3cret", false)
	lc.join(t, "llama", "a")
	for _, step := range []struct {
		what string
		a    chromedp.Action[chromedp.Void]
	}{
		{"load", chromedp.Navigate(lc.srv.URL + "/")},
		{"see the token form", chromedp.WaitVisible(chromedp.CSS("#login"))},
		{"type the token", chromedp.SendKeys(chromedp.CSS("#token"), "s3cret")},
		{"press Use", chromedp.Click(chromedp.CSS("#loginform button"))},
		{"see the member", chromedp.WaitVisible(chromedp.CSS(`tr[data-member="a"]`))},
	} {
		rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := chromedp.Do(rctx, step.a)
		cancel()
		if err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
	}
}
