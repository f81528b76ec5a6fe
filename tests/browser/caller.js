// The browser caller (see caller.html). Everything the test reads is in window.caller, polled over DevTools.
"use strict";

const { Room, RoomEvent, Track } = LivekitClient;
const SILENT = 1e-4; // an RMS (full scale 1.0) below this is silence

const caller = (window.caller = {
  state: "loading",
  error: null,
  log: [],
  agent: null, // identity of the first agent participant
  agentJoinedMs: null,
  agentTrackMs: null,
  micPublishedMs: null,
  canPlaybackAudio: null,
  transcripts: [], // {sender, text, attributes, done}
  heard: { sumSquares: 0, samples: 0, peak: 0, windows: 0, loudWindows: 0, maxRms: 0 },
  mic: [], // [ms since the mic was published, rms] every 50 ms
});

function note(msg) {
  const line = `${(performance.now() / 1000).toFixed(2)} ${msg}`;
  caller.log.push(line);
  document.getElementById("log").textContent += line + "\n";
}

function setState(s) {
  caller.state = s;
  document.title = `chorus caller: ${s}`;
  note(`state ${s}`);
}

let audioContext = null;
function context() {
  audioContext = audioContext || new AudioContext();
  return audioContext;
}

// an AnalyserNode on a MediaStreamTrack; `each(buf)` sees its latest window every `everyMs`
function analyse(mediaStreamTrack, everyMs, each) {
  const ctx = context();
  const source = ctx.createMediaStreamSource(new MediaStream([mediaStreamTrack]));
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 2048;
  source.connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  return setInterval(() => {
    analyser.getFloatTimeDomainData(buf);
    each(buf);
  }, everyMs);
}

function rmsPeak(buf) {
  let s = 0, p = 0;
  for (const x of buf) {
    s += x * x;
    p = Math.max(p, Math.abs(x));
  }
  return [Math.sqrt(s / buf.length), p, s];
}

function onAgent(p) {
  if (caller.agent === null && p.isAgent) {
    caller.agent = p.identity;
    caller.agentJoinedMs = performance.now();
    note(`agent joined: ${p.identity}`);
  }
}

async function main() {
  const q = new URLSearchParams(location.search);
  const room = (window.room = new Room({ adaptiveStream: false, dynacast: false }));
  room.on(RoomEvent.ParticipantConnected, onAgent);
  room.on(RoomEvent.AudioPlaybackStatusChanged, () => {
    caller.canPlaybackAudio = room.canPlaybackAudio;
    note(`canPlaybackAudio ${room.canPlaybackAudio}`);
  });
  room.on(RoomEvent.Disconnected, (reason) => setState(`disconnected ${reason}`));
  room.on(RoomEvent.TrackSubscribed, (track, _pub, participant) => {
    if (track.kind !== Track.Kind.Audio) return;
    onAgent(participant);
    // played through an <audio> element (Chromium feeds WebAudio a remote stream only while one plays it)
    document.body.appendChild(track.attach());
    caller.agentTrackMs = performance.now();
    note(`subscribed to ${participant.identity}'s audio`);
    const h = caller.heard;
    analyse(track.mediaStreamTrack, 20, (buf) => {
      const [rms, peak, s] = rmsPeak(buf);
      h.sumSquares += s;
      h.samples += buf.length;
      h.peak = Math.max(h.peak, peak);
      h.maxRms = Math.max(h.maxRms, rms);
      h.windows += 1;
      if (rms > SILENT) h.loudWindows += 1;
    });
  });
  room.registerTextStreamHandler("lk.transcription", async (reader, participantInfo) => {
    const t = { sender: participantInfo.identity, text: "", attributes: reader.info.attributes || {}, done: false };
    caller.transcripts.push(t);
    for await (const chunk of reader) t.text += chunk;
    t.done = true;
    note(`transcript from ${t.sender}: ${t.text}`);
  });

  setState("connecting");
  await room.connect(q.get("url"), q.get("token"));
  room.remoteParticipants.forEach(onAgent);
  caller.canPlaybackAudio = room.canPlaybackAudio;
  setState("connected");
  // the fake microphone plays its file from when it opens: open it once the agent listens
  while (caller.agentTrackMs === null) await new Promise((r) => setTimeout(r, 50));
  const pub = await room.localParticipant.setMicrophoneEnabled(true, {
    echoCancellation: false,
    noiseSuppression: false,
    autoGainControl: false,
    channelCount: 1,
  });
  caller.micPublishedMs = performance.now();
  const t0 = caller.micPublishedMs;
  analyse(pub.track.mediaStreamTrack, 50, (buf) => {
    caller.mic.push([Math.round(performance.now() - t0), rmsPeak(buf)[0]]);
  });
  setState("published");
}

main().catch((e) => {
  caller.error = String((e && e.stack) || e);
  setState("failed");
});
