package httpstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// Config is shared by Server and Client.
type Config struct {
	// Token, if set, must be sent by clients (Authorization: Bearer).
	Token string
	// MaxValueBytes bounds a value; default 64 MiB.
	MaxValueBytes int64
}

func (c Config) maxValue() int64 {
	if c.MaxValueBytes <= 0 {
		return 64 << 20
	}
	return c.MaxValueBytes
}

// Server hosts a Store for the other ranks.
type Server struct {
	cfg   Config
	ln    net.Listener
	srv   *http.Server
	store *memstore.Store
	done  chan error

	closeOnce sync.Once
	closeErr  error
}

// Listen binds addr ("host:port"; port 0 picks a free one) and serves.
func Listen(addr string, cfg Config) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("httpstore: listen %s: %w", addr, err)
	}
	s := &Server{cfg: cfg, ln: ln, store: memstore.New(), done: make(chan error, 1)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /set", s.handle(s.set))
	mux.HandleFunc("POST /get", s.handle(s.get))
	mux.HandleFunc("POST /add", s.handle(s.add))
	mux.HandleFunc("POST /delete", s.handle(s.del))
	mux.HandleFunc("POST /deleteprefix", s.handle(s.delPrefix))
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { s.done <- s.srv.Serve(ln) }() // exits in Close
	return s, nil
}

// Addr is the bound address ("127.0.0.1:41234").
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Store is the hosted store itself, for the hosting process (no HTTP).
func (s *Server) Store() comm.Store { return s.store }

// Close stops serving and wakes every waiting Get. Safe to call twice.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.store.Close()
		err := s.srv.Close()
		if serr := <-s.done; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		s.closeErr = err
	})
	return s.closeErr
}

type handler func(ctx context.Context, key string, body []byte, q url.Values) ([]byte, error)

func (s *Server) handle(h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.cfg.Token != "" && r.Header.Get("Authorization") != "Bearer "+s.cfg.Token {
			http.Error(w, "httpstore: bad token", http.StatusUnauthorized)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.maxValue()))
		if err != nil {
			http.Error(w, "httpstore: "+err.Error(), http.StatusRequestEntityTooLarge)
			return
		}
		q := r.URL.Query()
		out, err := h(r.Context(), q.Get("k"), body, q)
		switch {
		case errors.Is(err, comm.ErrClosed):
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		case errors.Is(err, comm.ErrInvalidArgument):
			http.Error(w, err.Error(), http.StatusBadRequest)
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		default:
			w.Write(out)
		}
	}
}

func (s *Server) set(ctx context.Context, k string, b []byte, _ url.Values) ([]byte, error) {
	return nil, s.store.Set(ctx, k, b)
}

func (s *Server) get(ctx context.Context, k string, _ []byte, _ url.Values) ([]byte, error) {
	return s.store.Get(ctx, k)
}

func (s *Server) add(ctx context.Context, k string, _ []byte, q url.Values) ([]byte, error) {
	d, err := strconv.ParseInt(q.Get("d"), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%w: httpstore: add: delta %q", comm.ErrInvalidArgument, q.Get("d"))
	}
	v, err := s.store.Add(ctx, k, d)
	return strconv.AppendInt(nil, v, 10), err
}

func (s *Server) del(ctx context.Context, k string, _ []byte, _ url.Values) ([]byte, error) {
	return nil, s.store.Delete(ctx, k)
}

func (s *Server) delPrefix(ctx context.Context, k string, _ []byte, _ url.Values) ([]byte, error) {
	return nil, s.store.DeletePrefix(ctx, k)
}

// Client is a comm.Store served by a Server.
type Client struct {
	base string
	cfg  Config
	hc   *http.Client
	tr   *http.Transport
}

var _ comm.Store = (*Client)(nil)

// NewClient returns a Store that talks to the Server at addr ("host:port").
// It connects on first use.
func NewClient(addr string, cfg Config) *Client {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &Client{base: "http://" + addr, cfg: cfg, hc: &http.Client{Transport: tr}, tr: tr}
}

// Close drops the client's idle connections. Safe to call twice.
func (c *Client) Close() error {
	c.tr.CloseIdleConnections()
	return nil
}

// notReached reports whether err says the request never reached a server
// (so retrying it cannot apply it twice).
func notReached(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial" || errors.Is(err, syscall.ECONNREFUSED)
}

func (c *Client) do(ctx context.Context, path, key string, body []byte, extra string) ([]byte, error) {
	u := c.base + path + "?k=" + url.QueryEscape(key) + extra
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 10*time.Millisecond, 500*time.Millisecond, 0
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
		if err != nil {
			return nil, fmt.Errorf("%w: httpstore: %v", comm.ErrInvalidArgument, err)
		}
		if c.cfg.Token != "" {
			req.Header.Set("Authorization", "Bearer "+c.cfg.Token)
		}
		resp, err := c.hc.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("httpstore: %s %q: %w", path[1:], key, context.Cause(ctx))
			}
			if !notReached(err) {
				return nil, fmt.Errorf("httpstore: %s %q: %w", path[1:], key, err)
			}
			t := time.NewTimer(b.NextBackOff())
			select {
			case <-t.C:
				continue
			case <-ctx.Done():
				t.Stop()
				return nil, fmt.Errorf("httpstore: %s %q: server %s not reached (%v): %w", path[1:], key, c.base, err, context.Cause(ctx))
			}
		}
		out, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case rerr != nil:
			return nil, fmt.Errorf("httpstore: %s %q: %w", path[1:], key, rerr)
		case resp.StatusCode == http.StatusOK:
			return out, nil
		case resp.StatusCode == http.StatusServiceUnavailable:
			return nil, fmt.Errorf("httpstore: %s %q: %w (%s)", path[1:], key, comm.ErrClosed, bytes.TrimSpace(out))
		case resp.StatusCode == http.StatusBadRequest:
			return nil, fmt.Errorf("httpstore: %s %q: %w (%s)", path[1:], key, comm.ErrInvalidArgument, bytes.TrimSpace(out))
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("httpstore: %s %q: %w", path[1:], key, context.Cause(ctx))
		}
		return nil, fmt.Errorf("httpstore: %s %q: %s: %s", path[1:], key, resp.Status, bytes.TrimSpace(out))
	}
}

// Set implements comm.Store.
func (c *Client) Set(ctx context.Context, key string, value []byte) error {
	_, err := c.do(ctx, "/set", key, value, "")
	return err
}

// Get implements comm.Store: it waits until key exists or ctx ends.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	return c.do(ctx, "/get", key, nil, "")
}

// Add implements comm.Store.
func (c *Client) Add(ctx context.Context, key string, delta int64) (int64, error) {
	b, err := c.do(ctx, "/add", key, nil, "&d="+strconv.FormatInt(delta, 10))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(b), 10, 64)
}

// Delete implements comm.Store.
func (c *Client) Delete(ctx context.Context, key string) error {
	_, err := c.do(ctx, "/delete", key, nil, "")
	return err
}

// DeletePrefix implements comm.Store.
func (c *Client) DeletePrefix(ctx context.Context, prefix string) error {
	_, err := c.do(ctx, "/deleteprefix", prefix, nil, "")
	return err
}
