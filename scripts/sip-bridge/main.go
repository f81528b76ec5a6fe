// sip-bridge stands in for LiveKit's SIP bridge's control plane (psrpc on Redis) toward a real LiveKit server; no SIP, RTP or G.711 is on the wire.
//
// LiveKit's SIP bridge (github.com/livekit/sip) does not build from the Go module proxy. This program speaks the
// part of it that the server sees: the psrpc calls on the server's Redis. `inbound` asks the server, as the
// bridge does on an INVITE, to authenticate the trunk (GetSIPTrunkAuthentication) and to evaluate the dispatch
// rules (EvaluateSIPDispatchRules), then signs the SIP participant's token (protocol's sip.BuildSIPToken) and
// prints it as one JSON line: whoever joins the room with it is the caller, a participant of kind SIP. `serve`
// registers as a bridge node (SIPInternal) and answers the CreateSIPParticipant and TransferSIPParticipant
// requests the server forwards, recording each as one JSON line.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/livekit/protocol/livekit"
	"github.com/livekit/protocol/rpc"
	"github.com/livekit/protocol/sip"
	"github.com/livekit/protocol/utils/guid"
	"github.com/livekit/psrpc"
)

const usage = `usage: sip-bridge inbound --from NUMBER --to TRUNK_NUMBER [--call-id ID] [--source-ip IP] [common flags]
       sip-bridge serve --record FILE.jsonl [--call-id ID ...] [common flags]
common flags: --redis host:port (CHORUS_TEST_LIVEKIT_REDIS), --url (LIVEKIT_URL), --api-key (LIVEKIT_API_KEY),
              --api-secret (LIVEKIT_API_SECRET)
It stands in for the SIP bridge's control plane (psrpc on Redis); no SIP, RTP or G.711 is on the wire.`

type common struct {
	redis, url, key, secret string
}

func (c *common) add(fs *flag.FlagSet) {
	fs.StringVar(&c.redis, "redis", os.Getenv("CHORUS_TEST_LIVEKIT_REDIS"), "the server's Redis, host:port")
	fs.StringVar(&c.url, "url", os.Getenv("LIVEKIT_URL"), "LiveKit server URL, given to joiners (LIVEKIT_URL)")
	fs.StringVar(&c.key, "api-key", os.Getenv("LIVEKIT_API_KEY"), "API key that signs tokens (LIVEKIT_API_KEY)")
	fs.StringVar(&c.secret, "api-secret", os.Getenv("LIVEKIT_API_SECRET"), "API secret (LIVEKIT_API_SECRET)")
}

func (c *common) check() error {
	var missing []string
	for name, v := range map[string]string{"--redis": c.redis, "--url": c.url, "--api-key": c.key, "--api-secret": c.secret} {
		if v == "" {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing %s", strings.Join(missing, ", "))
	}
	return nil
}

// bus connects to the server's Redis: psrpc's message bus, as the server and a real bridge use it.
func (c *common) bus(ctx context.Context) (psrpc.MessageBus, func(), error) {
	// as the server's Redis user (scripts/livekit.sh's start_livekit exports it; empty: no password)
	rc := redis.NewClient(&redis.Options{
		Addr:     c.redis,
		Username: os.Getenv("CHORUS_TEST_LIVEKIT_REDIS_SERVER_USERNAME"),
		Password: os.Getenv("CHORUS_TEST_LIVEKIT_REDIS_SERVER_PASSWORD"),
	})
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rc.Ping(pctx).Err(); err != nil {
		_ = rc.Close()
		return nil, nil, fmt.Errorf("redis %s: %w", c.redis, err)
	}
	return psrpc.NewRedisMessageBus(rc), func() { _ = rc.Close() }, nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "inbound":
		err = inbound(os.Args[2:])
	case "serve":
		err = serve(os.Args[2:])
	case "-h", "--help", "help":
		fmt.Println(usage)
		return
	default:
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	if err != nil {
		var u usageError
		if errors.As(err, &u) {
			fmt.Fprintf(os.Stderr, "sip-bridge %s: %v\n", os.Args[1], err)
			os.Exit(2)
		}
		// one JSON line on stdout for a caller that parses it, and one line on stderr for a person
		line, _ := json.Marshal(map[string]string{"error": err.Error()})
		fmt.Println(string(line))
		fmt.Fprintf(os.Stderr, "sip-bridge %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

type usageError struct{ error }

// inboundResult is what `inbound` prints: how to join as the caller, and what the server decided.
type inboundResult struct {
	URL          string            `json:"url"`
	Token        string            `json:"token"`
	Room         string            `json:"room"`
	Identity     string            `json:"identity"`
	Name         string            `json:"name"`
	Metadata     string            `json:"metadata"`
	Attributes   map[string]string `json:"attributes"`
	Dispatch     []string          `json:"dispatch"`
	CallID       string            `json:"call_id"`
	TrunkID      string            `json:"trunk_id"`
	RuleID       string            `json:"rule_id"`
	RoomPreset   string            `json:"room_preset,omitempty"`
	ServerSigned bool              `json:"server_signed"`
}

func inbound(args []string) error {
	fs := flag.NewFlagSet("inbound", flag.ContinueOnError)
	var c common
	c.add(fs)
	from := fs.String("from", "", "the calling number (the From user), e.g. +15550123")
	to := fs.String("to", "", "the called number (the To user): the inbound trunk's number")
	callID := fs.String("call-id", "", "LiveKit's call id (SCL_...); default: a new one")
	sourceIP := fs.String("source-ip", "127.0.0.1", "the SIP provider's address the INVITE came from")
	fromHost := fs.String("from-host", "sip.example.invalid", "the From URI's host")
	toHost := fs.String("to-host", "", "the To URI's host (default: none)")
	timeout := fs.Duration("timeout", 10*time.Second, "how long each request to the server may take")
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if *from == "" || *to == "" {
		return usageError{errors.New("--from and --to are required")}
	}
	if err := c.check(); err != nil {
		return usageError{err}
	}
	if *callID == "" {
		*callID = sip.NewCallID()
	}
	ctx := context.Background()
	bus, closeBus, err := c.bus(ctx)
	if err != nil {
		return err
	}
	defer closeBus()
	io, err := rpc.NewIOInfoClient(bus)
	if err != nil {
		return err
	}
	defer io.Close()

	to_ := &livekit.SIPUri{User: *to, Host: *toHost}
	call := &rpc.SIPCall{
		LkCallId: *callID,
		SourceIp: *sourceIP,
		From:     &livekit.SIPUri{User: *from, Host: *fromHost},
		To:       to_,
		Address:  to_,
	}
	auth, err := retry(ctx, *timeout, func(rctx context.Context) (*rpc.GetSIPTrunkAuthenticationResponse, error) {
		return io.GetSIPTrunkAuthentication(rctx, &rpc.GetSIPTrunkAuthenticationRequest{Call: call},
			psrpc.WithRequestTimeout(*timeout))
	})
	if err != nil {
		return fmt.Errorf("trunk authentication: %w", err)
	}
	switch {
	case auth.Drop:
		return errors.New("trunk authentication: the server says drop the call")
	case auth.ErrorCode != rpc.SIPTrunkAuthenticationError_SIP_TRUNK_AUTH_ERROR_NONE:
		return fmt.Errorf("trunk authentication: %s", auth.ErrorCode)
	case auth.Username != "" || auth.Password != "":
		return errors.New("trunk authentication: the trunk asks for digest auth, which this stand-in does not answer")
	}

	resp, err := retry(ctx, *timeout, func(rctx context.Context) (*rpc.EvaluateSIPDispatchRulesResponse, error) {
		return io.EvaluateSIPDispatchRules(rctx, &rpc.EvaluateSIPDispatchRulesRequest{
			SipTrunkId: auth.SipTrunkId,
			Call:       call,
		}, psrpc.WithRequestTimeout(*timeout))
	})
	if err != nil {
		return fmt.Errorf("dispatch rules: %w", err)
	}
	switch resp.Result {
	case rpc.SIPDispatchResult_ACCEPT, rpc.SIPDispatchResult_LEGACY_ACCEPT_OR_PIN:
	case rpc.SIPDispatchResult_DROP:
		return fmt.Errorf("dispatch rules: no rule matched (trunk %q): the call is dropped", resp.SipTrunkId)
	default:
		return fmt.Errorf("dispatch rules: %s (this stand-in does not prompt for a PIN)", resp.Result)
	}
	if resp.RoomName == "" {
		return errors.New("dispatch rules: accepted without a room")
	}

	attrs := map[string]string{}
	for k, v := range resp.ParticipantAttributes {
		attrs[k] = v
	}
	// the bridge joins the room while the phone still rings and marks the call active once it has
	// subscribed to a track there (the agent's); whoever joins with this token does the latter
	attrs[livekit.AttrSIPCallStatus] = "ringing"
	token, url, signed := resp.Token, resp.WsUrl, true
	if url == "" {
		url = c.url
	}
	if token == "" {
		signed = false
		token, err = sip.BuildSIPToken(sip.SIPTokenParams{
			APIKey:                c.key,
			APISecret:             c.secret,
			RoomName:              resp.RoomName,
			ParticipantIdentity:   resp.ParticipantIdentity,
			ParticipantName:       resp.ParticipantName,
			ParticipantMetadata:   resp.ParticipantMetadata,
			ParticipantAttributes: attrs,
			RoomPreset:            resp.RoomPreset,
			RoomConfig:            resp.RoomConfig,
		})
		if err != nil {
			return fmt.Errorf("signing the SIP participant's token: %w", err)
		}
	}
	dispatch := []string{}
	for _, a := range resp.GetRoomConfig().GetAgents() {
		dispatch = append(dispatch, a.AgentName)
	}
	return printJSON(inboundResult{
		URL: url, Token: token, Room: resp.RoomName, Identity: resp.ParticipantIdentity,
		Name: resp.ParticipantName, Metadata: resp.ParticipantMetadata, Attributes: attrs, Dispatch: dispatch,
		CallID: *callID, TrunkID: resp.SipTrunkId, RuleID: resp.SipDispatchRuleId, RoomPreset: resp.RoomPreset,
		ServerSigned: signed,
	})
}

// retry sends a request again while no server answered it: psrpc's Redis bus subscribes to a new client's
// response channels in the background, so the first request of a fresh process can go out before they are
// listened to, and its answer is lost. Both requests `inbound` sends are safe to repeat.
func retry[T any](ctx context.Context, total time.Duration, send func(context.Context) (T, error)) (T, error) {
	deadline := time.Now().Add(total)
	for wait := 50 * time.Millisecond; ; wait *= 2 {
		rctx, cancel := context.WithDeadline(ctx, deadline)
		res, err := send(rctx)
		cancel()
		if err == nil || !errors.Is(err, psrpc.ErrNoResponse) || time.Now().Add(wait).After(deadline) {
			return res, err
		}
		time.Sleep(wait)
	}
}

func printJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(b))
	return err
}

// multi is a repeatable string flag.
type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

// bridge is the SIPInternal service: it records what the server asks of a bridge and answers as one would.
type bridge struct {
	c      common
	nodeID string
	mu     sync.Mutex
	record *os.File
	server rpc.SIPInternalServer
}

func (b *bridge) write(entry map[string]any) error {
	entry["node_id"] = b.nodeID
	entry["at"] = time.Now().UTC().Format(time.RFC3339Nano)
	line, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.record.Write(append(line, '\n')); err != nil {
		return err
	}
	return b.record.Sync()
}

// CreateSIPParticipant is an outbound call: a real bridge dials the callee and, once they answer, joins the
// room as them. This one answers at once and records a token that lets whoever plays the callee join as that
// participant (kind SIP, the bridge's sip.* attributes).
func (b *bridge) CreateSIPParticipant(ctx context.Context, req *rpc.InternalCreateSIPParticipantRequest) (*rpc.InternalCreateSIPParticipantResponse, error) {
	callID := req.SipCallId
	if callID == "" {
		callID = sip.NewCallID()
	}
	attrs := map[string]string{}
	for k, v := range req.ParticipantAttributes {
		attrs[k] = v
	}
	attrs[livekit.AttrSIPCallID] = callID
	attrs[livekit.AttrSIPTrunkID] = req.SipTrunkId
	attrs[livekit.AttrSIPPhoneNumber] = req.CallTo
	attrs[livekit.AttrSIPTrunkNumber] = req.Number
	attrs[livekit.AttrSIPHostName] = req.Address
	attrs[livekit.AttrSIPCallStatus] = "active"
	token, url := req.Token, req.WsUrl
	if url == "" {
		url = b.c.url
	}
	if token == "" {
		var err error
		token, err = sip.BuildSIPToken(sip.SIPTokenParams{
			APIKey:                b.c.key,
			APISecret:             b.c.secret,
			RoomName:              req.RoomName,
			ParticipantIdentity:   req.ParticipantIdentity,
			ParticipantName:       req.ParticipantName,
			ParticipantMetadata:   req.ParticipantMetadata,
			ParticipantAttributes: attrs,
		})
		if err != nil {
			return nil, psrpc.NewError(psrpc.Internal, err)
		}
	}
	participantID := guid.New(guid.ParticipantPrefix)
	entry := map[string]any{
		"method":                 "CreateSIPParticipant",
		"sip_call_id":            callID,
		"sip_trunk_id":           req.SipTrunkId,
		"number":                 req.Number,
		"call_to":                req.CallTo,
		"address":                req.Address,
		"room":                   req.RoomName,
		"participant_identity":   req.ParticipantIdentity,
		"participant_name":       req.ParticipantName,
		"participant_metadata":   req.ParticipantMetadata,
		"participant_attributes": req.ParticipantAttributes,
		"wait_until_answered":    req.WaitUntilAnswered,
		"dtmf":                   req.Dtmf,
		"participant_id":         participantID,
		"url":                    url,
		"token":                  token,
	}
	if err := b.write(entry); err != nil {
		return nil, psrpc.NewError(psrpc.Internal, err)
	}
	// the server forwards a transfer of this participant to the topic of its call id
	if err := b.server.RegisterTransferSIPParticipantTopic(callID); err != nil {
		fmt.Fprintf(os.Stderr, "sip-bridge serve: cannot take transfers of call %s: %v\n", callID, err)
	}
	fmt.Fprintf(os.Stderr, "sip-bridge serve: outbound call %s answered (room has %d chars)\n", callID, len(req.RoomName))
	return &rpc.InternalCreateSIPParticipantResponse{
		ParticipantId:       participantID,
		ParticipantIdentity: req.ParticipantIdentity,
		SipCallId:           callID,
	}, nil
}

// TransferSIPParticipant is a SIP REFER: a real bridge hands the call to `transfer_to`, then leaves the room.
// This one records it and answers that the transfer succeeded.
func (b *bridge) TransferSIPParticipant(ctx context.Context, req *rpc.InternalTransferSIPParticipantRequest) (*emptypb.Empty, error) {
	entry := map[string]any{
		"method":        "TransferSIPParticipant",
		"sip_call_id":   req.SipCallId,
		"transfer_to":   req.TransferTo,
		"play_dialtone": req.PlayDialtone,
		"headers":       req.Headers,
	}
	if err := b.write(entry); err != nil {
		return nil, psrpc.NewError(psrpc.Internal, err)
	}
	fmt.Fprintf(os.Stderr, "sip-bridge serve: call %s transferred\n", req.SipCallId)
	return &emptypb.Empty{}, nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	var c common
	c.add(fs)
	recordPath := fs.String("record", "", "append one JSON line per request here")
	var callIDs multi
	fs.Var(&callIDs, "call-id", "also take transfers of this call (an inbound call's id; repeat)")
	if err := fs.Parse(args); err != nil {
		return usageError{err}
	}
	if *recordPath == "" {
		return usageError{errors.New("--record FILE is required")}
	}
	if err := c.check(); err != nil {
		return usageError{err}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	f, err := os.OpenFile(*recordPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	bus, closeBus, err := c.bus(ctx)
	if err != nil {
		return err
	}
	defer closeBus()
	b := &bridge{c: c, nodeID: guid.New("NE_"), record: f}
	srv, err := rpc.NewSIPInternalServer(b, bus)
	if err != nil {
		return err
	}
	b.server = srv
	defer srv.Shutdown()
	// the server sends CreateSIPParticipant to the empty topic: any bridge node may claim it
	if err := srv.RegisterCreateSIPParticipantTopic(""); err != nil {
		return err
	}
	for _, id := range callIDs {
		if err := srv.RegisterTransferSIPParticipantTopic(id); err != nil {
			return err
		}
	}
	// psrpc's Redis bus subscribes in the background: give it a moment before saying the node is ready
	time.Sleep(500 * time.Millisecond)
	if err := printJSON(map[string]any{"ready": true, "node_id": b.nodeID}); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}
